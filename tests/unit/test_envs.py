"""The environment contract, SingleTurn, ToolEnvironment episodes, and loading specs."""

import math

import pytest

from miles.envs import (BUILTIN_ENVIRONMENTS, Action, CalculatorEnv, Environment, PythonEnv,
                        SingleTurn, Step, Task, ToolEnvironment, load_environment)
from miles.envs.tool_env import INFO_BUDGET_EXHAUSTED
from miles.envs.tools import ToolSettings
from miles.errors import ConfigError, EnvError
from miles.tasks.rewards import resolve_reward

MATH = resolve_reward("math")


# --- the contract's data types ----------------------------------------------------------------

def test_task_accepts_text_or_messages_and_freezes_them():
    chat = Task([{"role": "user", "content": "2+2?"}], "4", {"id": 7})
    assert isinstance(chat.prompt, tuple) and chat.prompt[0]["content"] == "2+2?"
    assert chat.prompt_text == "2+2?" and chat.metadata["id"] == 7
    with pytest.raises(TypeError):
        chat.metadata["id"] = 8  # read-only view
    assert Task("2+2?").prompt_text == "2+2?"


@pytest.mark.parametrize("prompt, message", [
    (3, "Task.prompt must be a string or a non-empty sequence"),
    ([], "Task.prompt must be a string or a non-empty sequence"),
    ([{"role": "robot", "content": "hi"}], r"Task.prompt message 0 must be a mapping with a role"),
    ([{"role": "user"}], r"Task.prompt message 0 must be a mapping"),
])
def test_task_rejects_malformed_prompts(prompt, message):
    with pytest.raises(EnvError, match=message):
        Task(prompt)


def test_action_validates_its_finish_reason_and_keeps_token_ids_as_a_tuple():
    assert Action("hi", [1, 2], "stop_string").token_ids == (1, 2)
    with pytest.raises(EnvError, match="finish_reason must be one of"):
        Action("hi", (1,), "abort")


@pytest.mark.parametrize("kwargs, message", [
    ({"observation": None}, "None only when done"),
    ({"observation": "x", "reward": math.nan}, "reward must be finite"),
    ({"observation": None, "done": True, "reward": math.inf}, "reward must be finite"),
    ({"observation": "x", "reward": "1"}, "reward must be a number"),
    ({"observation": "x", "reward": True}, "reward must be a number"),
    ({"observation": 5}, "Step.observation must be a string"),
    ({"observation": "x", "info": [1]}, "Step.info must be a mapping"),
])
def test_step_validation(kwargs, message):
    with pytest.raises(EnvError, match=message):
        Step(**kwargs)


def test_a_valid_step_is_normalised():
    step = Step("ok", 1, info={"tool_calls": 2})
    assert (step.reward, step.done, dict(step.info)) == (1.0, False, {"tool_calls": 2})
    assert type(step.reward) is float
    assert Step(None, done=True).reward is None


def test_stop_strings_are_checked_when_the_class_is_defined():
    with pytest.raises(EnvError, match="stop_strings must be a tuple of non-empty strings"):
        class Bad(Environment):  # noqa: F841
            stop_strings = ["</tool>"]


# --- SingleTurn: today's rewards as the one-step case -----------------------------------------

async def test_single_turn_scores_with_a_builtin_reward():
    env = SingleTurn(reward=MATH)
    assert await env.reset(Task("What is 6*7?", "42")) is None  # the prompt as is
    step = await env.step(Action("so the answer is \\boxed{42}", (5, 6), "stop"))
    assert (step.observation, step.reward, step.done, dict(step.info)) == (None, 1.0, True, {})
    await env.close()


async def test_single_turn_reports_a_failing_plugin_as_information():
    env = SingleTurn(reward=resolve_reward("tests.rewards:slow", timeout_s=0.2))
    await env.reset(Task("q", "a"))
    step = await env.step(Action("slow"))
    assert (step.reward, step.done) == (0.0, True)
    assert step.info["error"] == "reward timed out after 0.2 s"


async def test_single_turn_refuses_steps_outside_an_episode():
    env = SingleTurn(reward=MATH)
    with pytest.raises(EnvError, match="before reset"):
        await env.step(Action("1"))
    await env.reset(Task("q", "1"))
    await env.step(Action("1"))
    with pytest.raises(EnvError, match="after the episode ended"):
        await env.step(Action("1"))


# --- ToolEnvironment episodes -----------------------------------------------------------------

async def test_a_two_call_calculator_episode():
    env = load_environment("calculator", reward=MATH)()
    assert env.stop_strings == ("</tool>",)
    assert await env.reset(Task("What is (123*456) + 789?", "56877")) is None
    first = await env.step(Action("<tool>calculator: 123*456</tool>", (1,), "stop_string"))
    assert (first.observation, first.done, dict(first.info)) == \
        ("<result>56088</result>", False, {"tool_calls": 1, "tool_errors": 0})
    second = await env.step(Action("<tool>calculator: 56088 + 789</tool>", (2,), "stop_string"))
    assert second.observation == "<result>56877</result>" and not second.done
    final = await env.step(Action("The answer is 56877", (3,), "stop"))
    assert (final.observation, final.reward, final.done) == (None, 1.0, True)
    assert dict(final.info) == {"tool_calls": 0, "tool_errors": 0}


async def test_tool_errors_are_counted_and_the_episode_goes_on():
    env = CalculatorEnv(reward=MATH)
    await env.reset(Task("q", "2"))
    step = await env.step(Action("<tool>calculator: 1/0</tool><tool>nope: 1</tool>"))
    assert not step.done and dict(step.info) == {"tool_calls": 2, "tool_errors": 2}
    assert step.observation == ("<result>error: division by zero</result>\n"
                                "<result>error: unknown tool 'nope' (tools: calculator)</result>")


async def test_the_tool_turn_budget_ends_the_episode():
    env = CalculatorEnv(reward=MATH, settings=ToolSettings(max_tool_turns=1))
    await env.reset(Task("q", "2"))
    assert not (await env.step(Action("<tool>calculator: 1+1</tool>"))).done
    final = await env.step(Action("<tool>calculator: 1+1</tool> 2"))
    assert final.done and final.info[INFO_BUDGET_EXHAUSTED] is True
    assert final.reward == 1.0  # the text was scored as the answer


async def test_json_style_episode_with_chat_observations():
    class ChatAdder(ToolEnvironment):
        tools = (lambda_free_add,)
        chat_observations = True

    env = ChatAdder(reward=MATH)
    assert env.stop_strings == ("</tool_call>",)
    await env.reset(Task([{"role": "user", "content": "2+3?"}], "5"))
    call = '<tool_call>{"name": "lambda_free_add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    step = await env.step(Action(call, (9,), "stop_string"))
    assert step.observation == ({"role": "tool", "content": "5"},)
    assert env.tool_schemas()[0]["function"]["parameters"]["required"] == ["a", "b"]


def lambda_free_add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


async def test_the_python_environment_runs_code_in_the_sandbox():
    env = PythonEnv(reward=MATH)
    await env.reset(Task("q", "120"))
    call = '<tool_call>{"name": "python", "arguments": {"code": "import math\\n' \
           'print(math.factorial(5))"}}</tool_call>'
    step = await env.step(Action(call))
    assert step.observation == "<tool_response>\n120\n</tool_response>"
    code = "open('/etc/passwd')"
    failing = await env.step(Action(
        f'<tool_call>{{"name": "python", "arguments": {{"code": "{code}"}}}}</tool_call>'))
    assert failing.info["tool_errors"] == 1
    assert failing.observation.startswith(
        "<tool_response>\nerror: the code raised an error (exit code 1)\nTraceback")
    assert "sandbox: reading '/etc/passwd' is not allowed" in failing.observation


# --- loading ----------------------------------------------------------------------------------

def test_builtins_and_plugins_load_as_fresh_instance_factories():
    assert set(BUILTIN_ENVIRONMENTS) == {"single_turn", "calculator", "python"}
    factory = load_environment("single_turn", reward=MATH)
    first, second = factory(), factory()
    assert isinstance(first, SingleTurn) and first is not second and first.reward is MATH
    echo = load_environment("tests.envs:Echo")()  # takes no reward: built without one
    assert type(echo).__name__ == "Echo"
    assert load_environment("tests.envs:Adder", reward=MATH)().reward is MATH


@pytest.mark.parametrize("spec, message", [
    ("nope", r"env must be one of \['calculator', 'python', 'single_turn'\] or package"),
    ("no.such.module:Env", "env 'no.such.module:Env': module 'no.such.module' cannot be "
                           "imported: ModuleNotFoundError"),
    ("tests.envs:Missing", "env 'tests.envs:Missing': module 'tests.envs' has no attribute "
                           "'Missing'"),
    ("tests.envs:NOT_A_CLASS", "env 'tests.envs:NOT_A_CLASS' is not an Environment subclass"),
    ("tests.envs:NotAnEnvironment", "is not an Environment subclass"),
    ("tests.envs:Unfinished", r"env 'tests.envs:Unfinished' is abstract: .*'step'"),
    ("tests.envs:NeedsConfig", "env 'tests.envs:NeedsConfig' cannot be built with no arguments"),
])
def test_loader_errors_name_the_spec(spec, message):
    with pytest.raises(ConfigError, match=message):
        load_environment(spec, reward=MATH)


def test_an_environment_that_needs_a_reward_without_one_is_a_config_error():
    with pytest.raises(ConfigError, match="env 'calculator' needs a reward"):
        load_environment("calculator")


# --- the documented example runs --------------------------------------------------------------

def python_blocks(path: str) -> list[str]:
    import pathlib
    import re

    text = pathlib.Path(path).read_text(encoding="utf-8")
    return re.findall(r"```python\n(.*?)```", text, re.DOTALL)


async def test_the_guessing_game_in_docs_environments_md_plays_as_documented():
    blocks = [b for b in python_blocks("docs/environments.md") if "GuessTheNumber" in b]
    namespace = {"__name__": "docs_example"}
    exec(compile(blocks[0], "docs/environments.md", "exec"), namespace)  # noqa: S102
    steps = await namespace["play"]()
    assert [s.observation for s in steps] == ["50 is wrong, go lower.",
                                             "25 is wrong, go higher.", None]
    assert [s.reward for s in steps] == [-0.1, -0.1, 1.0] and steps[-1].done


async def test_the_tool_example_in_docs_environments_md_runs():
    (block,) = [b for b in python_blocks("docs/environments.md") if "WordLengths" in b]
    namespace = {"__name__": "docs_example"}
    exec(compile(block, "docs/environments.md", "exec"), namespace)  # noqa: S102
    env = namespace["WordLengths"](reward=MATH)
    assert env.stop_strings == ("</tool>",)
    await env.reset(Task("How many letters has banana?", "6"))
    step = await env.step(Action("<tool>word_length: banana</tool>", finish_reason="stop_string"))
    assert step.observation == "<result>6</result>"
    assert (await env.step(Action("6"))).reward == 1.0


async def test_the_readme_example_is_the_docs_and_runs_through_the_producers_runner(
        tmp_path, monkeypatch):
    """README's "Write an environment" example, saved as the module it says, loaded by its spec
    and played by the producer's EpisodeRunner (scripted engine: call the tool, then answer)."""
    from miles.episodes import EpisodeRunner, EpisodeSettings
    from miles.protocol import PromptTask
    from miles.rl.sampling import SamplingParams
    from miles.tasks.tiny_model import build_char_tokenizer
    from tests.scripted import ScriptedEngine

    (block,) = [b for b in python_blocks("README.md") if "class " in b]
    assert block in python_blocks("docs/environments.md")  # one example, not two
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "envs.py").write_text(block)
    monkeypatch.syspath_prepend(str(tmp_path))
    factory = load_environment("mypkg.envs:WordLengths", reward=MATH)
    build_char_tokenizer(chat=True).save_pretrained(tmp_path / "tokenizer")
    engine = ScriptedEngine(tmp_path / "tokenizer", lambda text: "6" if "<result>" in text
                            else "<tool>word_length: banana</tool>")

    async def generate(prompts, params, **kwargs):
        return engine.generate(prompts, params, **kwargs)

    runner = EpisodeRunner(engine, factory, EpisodeSettings(),
                           SamplingParams(n=2, max_new_tokens=40), generate_in_engine=generate)
    prompt = "Letters in banana?"
    task = PromptTask(task_id="w", prompt=prompt, reference="6", created_at=0.0)
    ((first, second),) = await runner.run([(task, engine.encode(prompt))], seed=0)
    for record in (first, second):
        sample = record.sample()
        assert record.failure is None and record.tool_calls == 1 and sample.reward == 1.0
        assert engine.decode(sample.response_token_ids.tolist()) == (
            "<tool>word_length: banana</tool><result>6</result>6")
        assert sample.loss_mask.tolist().count(0) == len(engine.encode("<result>6</result>"))
