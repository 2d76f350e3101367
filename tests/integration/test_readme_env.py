"""The README's "Write an environment" example, as a doc test: its code block is the shipped
module (`examples/envs/word_lengths.py`), its command runs as printed (for a few seconds, on a
tiny chat model warmed up on the tool format), and the model's tool calls reach the tool:
the stop string survives the tokenizer and the report counts tool calls. A tokenizer that
cannot write the stop string stops the run at start-up."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from miles.cli import main
from miles.envs import load_environment
from transformers import AutoTokenizer

from examples.envs.word_lengths import WordLengths
from miles.sft import SFTConfig, supervised_warm_start
from miles.tasks.datasets import load_problems
from miles.tasks.arithmetic import Problem
from miles.tasks.tiny_model import build_tiny_model

ROOT = Path(__file__).resolve().parents[2]
SECTION = re.search(r"## Write an environment\n(.*?)\n## ", (ROOT / "README.md").read_text(),
                    re.DOTALL).group(1)


def readme_block(language: str) -> str:
    return re.search(rf"```{language}\n(.*?)```", SECTION, re.DOTALL).group(1)


def readme_command() -> list[str]:
    words = shlex.split(readme_block("bash").replace("\\\n", " "))
    assert words[:4] == ["python", "-m", "miles.cli", "demo"]
    return words[4:]


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    """The tiny chat model after a short SFT on the first turn: `<tool>word_length: W</tool>`."""
    base = build_tiny_model(tmp_path_factory.mktemp("chat"), hidden_size=64, layers=2,
                            chat=True)
    words = load_problems(str(ROOT / "examples/envs/words.jsonl"))
    calls = [Problem(task_id=p.task_id, prompt=p.prompt,
                     answer=f"<tool>word_length: {p.task_id}</tool>") for p in words]
    return supervised_warm_start(base, tmp_path_factory.mktemp("sft"), calls,
                                 SFTConfig(steps=20, batch_size=8, lr=1e-2, warmup_steps=2))


def test_the_readme_example_is_the_shipped_module():
    shipped = (ROOT / "examples/envs/word_lengths.py").read_text()
    assert readme_block("python") in shipped
    spec = readme_command()[readme_command().index("--env") + 1]
    assert spec == "examples.envs.word_lengths:WordLengths"


def test_the_readme_command_calls_the_tool(tool_model, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the command's paths are the repository's
    args = readme_command()
    args[args.index("--rl-seconds") + 1] = "4"
    assert main(["demo", *args, "--model-dir", str(tool_model), "--out", str(tmp_path),
                 "--set", "eval_problems=4", "--set", "groups_per_step=4",
                 "--set", "sampling.n=4"]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    episodes = report["episodes"]
    assert episodes["episodes"] > 0 and episodes["tool_calls"] > 0, episodes
    assert episodes["failed_episodes"] == 0
    # counted, not silent: a half-trained model's misspelt tool name gets an error result
    # quoting it ("unknown tool 'word_lengt'"), and the tiny tokenizer has no quote character
    assert "unk_observations" in episodes
    tokenizer = AutoTokenizer.from_pretrained(tool_model)
    for stop in WordLengths.stop_strings:
        ids = tokenizer.encode(stop, add_special_tokens=False)
        assert tokenizer.unk_token_id not in ids and tokenizer.decode(ids) == stop


def test_a_tokenizer_without_the_tags_stops_the_run(model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    assert main(["demo", *readme_command(), "--model-dir", str(model_dir),
                 "--out", str(tmp_path)]) == 2
    assert re.search(r"env examples.envs.word_lengths.WordLengths: its stop string '</tool>' "
                     "encodes to the unknown token", capsys.readouterr().err)
    assert not (tmp_path / "report.json").exists()


def test_a_run_with_an_environment_warms_up_the_chat_tokenizer(tmp_path, monkeypatch):
    """The built-in tiny model of a run with a user environment has the tags' characters."""
    from transformers import AutoTokenizer

    import miles.warm_start
    from miles.run import RunConfig
    from miles.warm_start import warm_start

    monkeypatch.setattr(miles.warm_start, "CACHE", tmp_path)
    config = RunConfig(env="examples.envs.word_lengths:WordLengths",
                       prompts=str(ROOT / "examples/envs/words.jsonl"),
                       sft=SFTConfig(steps=1, batch_size=2, warmup_steps=1))
    tokenizer = AutoTokenizer.from_pretrained(warm_start(config))
    call = "<tool>word_length: banana</tool>"
    assert tokenizer.unk_token_id not in tokenizer.encode(call, add_special_tokens=False)
    assert tokenizer.decode(tokenizer.encode(call, add_special_tokens=False)) == call


async def test_an_observation_the_tokenizer_cannot_read_is_counted(tmp_path):
    """A misspelt tool's error result quotes its name; the chat tokenizer has no quote: the
    observation reaches the model with unknown tokens, and the episode counts it."""
    import asyncio

    from miles.episodes import EpisodeRunner, EpisodeSettings
    from miles.protocol import PromptTask
    from miles.rl.sampling import SamplingParams
    from miles.tasks.rewards import resolve_reward
    from miles.tasks.tiny_model import build_char_tokenizer
    from tests.scripted import ScriptedEngine

    build_char_tokenizer(chat=True).save_pretrained(tmp_path)
    engine = ScriptedEngine(tmp_path, lambda prompt: "6" if "<result>" in prompt
                            else "<tool>word_lengt: banana</tool>")

    async def generate(prompts, params, **kwargs):
        return await asyncio.to_thread(engine.generate, prompts, params, **kwargs)

    factory = load_environment("examples.envs.word_lengths:WordLengths",
                               reward=resolve_reward("exact_match"))
    runner = EpisodeRunner(engine, factory, EpisodeSettings(max_total_tokens=100),
                           SamplingParams(n=1, max_new_tokens=40), generate_in_engine=generate)
    task = PromptTask(task_id="banana", prompt="banana:", reference="6", created_at=0.0)
    ((record,),) = await runner.run([(task, engine.encode(task.prompt))], 0)
    assert record.tool_calls == 1 and record.tool_errors == 1 and record.unk_observations == 1
