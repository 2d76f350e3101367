"""Chat episodes: the first prompt and every observation rendered through a real chat template
(the tiny chat tokenizer's, or a tiny BPE's, saved with save_pretrained), each rendering checked
to extend the text of the sampled tokens, kept as sampled even when another tokenization of
their text is the tokenizer's own; a template that rewrites earlier turns fails the episode
with that reason; a tool environment's tools reach the template."""

from __future__ import annotations

import asyncio
import functools
import json

import pytest
from transformers import AutoTokenizer

from miles.engines import HFEngine
from miles.episodes import MESSAGES_KEY, EpisodeRunner, EpisodeSettings
from miles.protocol import PromptTask
from miles.rl.sampling import SamplingParams
from miles.tasks.rewards import resolve_reward
from miles.tasks.tiny_model import (CHAT_TEMPLATE, build_bpe_tokenizer, build_char_tokenizer,
                                     build_tiny_model)
from tests import envs
from tests.scripted import ScriptedEngine

TRIMMING_TEMPLATE = CHAT_TEMPLATE.replace("message['content']", "(message['content'] | trim)")
"""Like Llama 3's, which trims every message: an earlier turn ' 4 ' renders as '4'."""
TOOLS_TEMPLATE = "{%- if tools -%}{{- '<tools>' + (tools | tojson) + '\n' -}}{%- endif -%}" + \
    CHAT_TEMPLATE
"""The tiny chat template, with the tools first when there are any, as Qwen's or Hermes' do."""
REPLY = "the answer is 4"
BPE_CORPUS = [f"<system>Count.\n<user>2+3=\n<assistant>{REPLY}</s>\n<tool>n={k}.\n"
              for k in range(1, 4)] * 20
SAMPLING = SamplingParams(n=2, temperature=1.0, max_new_tokens=6)
MESSAGES = [{"role": "system", "content": "Count."}, {"role": "user", "content": "2+3="}]
WAIT_S = 120.0


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("chat"), hidden_size=64, layers=2,
                            max_positions=256, chat=True)


@pytest.fixture(scope="module")
def engine(chat_dir):
    return HFEngine(chat_dir)


@pytest.fixture(autouse=True)
def fresh_counters():
    envs.Counter.seen, envs.Counter.closed = [], 0


def chat_task(name: str = "a", messages=MESSAGES, **metadata) -> PromptTask:
    raw = messages if isinstance(messages, str) else json.dumps(messages)
    return PromptTask(task_id=name, prompt="2+3=", reference="5",
                      metadata={"name": name, MESSAGES_KEY: raw, **metadata}, created_at=0.0)


async def run_episodes(engine, factory, tasks, sampling=SAMPLING):
    async def generate(prompts, params, **kwargs):
        return await asyncio.to_thread(engine.generate, prompts, params, **kwargs)

    runner = EpisodeRunner(engine, factory, EpisodeSettings(), sampling,
                           generate_in_engine=generate)
    prompts = [(t, engine.encode(t.prompt)) for t in tasks]
    return await asyncio.wait_for(runner.run(prompts, 0), WAIT_S)


def scripted(tokenizer_dir, replies: list[str]) -> ScriptedEngine:
    """Turn k of every episode says `replies[k]` (then EOS)."""
    def reply(prompt: str) -> str:
        turn = prompt.count("<assistant>") - 1  # one generation prompt per turn so far
        return replies[min(turn, len(replies) - 1)]
    return ScriptedEngine(tokenizer_dir, reply)


def rendered(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


async def test_chat_observations_extend_the_sampled_tokens(engine):
    (group,) = await run_episodes(engine, envs.ChatCounter, [chat_task()])
    tokenizer = engine.tokenizer
    assert tokenizer.chat_template == CHAT_TEMPLATE  # the real template, from save_pretrained
    for record in group:
        assert record.failure is None and len(record.turns) == 3
        assert record.prompt == rendered(tokenizer, MESSAGES)
        sample = record.sample()
        conversation = list(MESSAGES)
        for k, turn in enumerate(record.turns[:2], start=1):
            conversation += [{"role": "assistant", "content": engine.decode(
                turn.completion.token_ids)}, {"role": "tool", "content": f"n={k}."}]
        # the context up to the last observation is exactly the rendering of the conversation
        context = record.prompt + sample.response_token_ids[:sample.turn_ends[1]].tolist()
        assert context == rendered(tokenizer, conversation)
        first = record.turns[0]
        observation = engine.decode(first.observation)
        assert observation.endswith("<tool>n=1.\n<assistant>")
        if first.completion.finish_reason != "stop":  # no EOS sampled: the template closes it
            assert first.observation[0] == engine.eos_token_id
        assert (sample.loss_mask[sample.turn_ends[0] - len(first.observation):
                                 sample.turn_ends[0]] == 0).all()


async def test_a_template_that_rewrites_earlier_turns_fails_the_episode(chat_dir, tmp_path):
    trimming = build_char_tokenizer(chat=True, chat_template=TRIMMING_TEMPLATE)
    trimming.save_pretrained(tmp_path)
    replies = [" 4 ", "5"]
    (broken,) = await run_episodes(scripted(tmp_path, replies), envs.ChatCounter,
                                   [chat_task()])
    for record in broken:
        assert record.failure_kind == "template" and len(record.turns) == 1
        assert "does not extend the text so far" in record.failure
        assert "character 0 of the model's last turn" in record.failure  # the trimmed ' 4 '
        assert record.sample().finish_reason == "abort"
    (fine,) = await run_episodes(scripted(chat_dir, replies), envs.ChatCounter,
                                 [chat_task()])
    assert all(r.failure is None and len(r.turns) == 3 for r in fine)  # the template's fault


async def test_text_first_observations_and_mismatched_kinds(engine, chat_dir):
    text_task = PromptTask(task_id="t", prompt="2+3=", metadata={"name": "t"}, created_at=0.0)
    (greeted,) = await run_episodes(engine, envs.Greeter, [text_task])
    assert all(r.prompt == engine.encode("Hi. 2+3=") and r.failure is None for r in greeted)
    (mixed,) = await run_episodes(engine, envs.ChatCounter, [text_task])
    assert all(r.failure_kind == "template" and "plain text" in r.failure for r in mixed)
    (bad,) = await run_episodes(engine, envs.ChatCounter, [chat_task(messages="[{]")])
    assert all(r.failure_kind == "bad_task" and not r.turns for r in bad)
    assert all(r.sample() is None for r in bad)  # nothing generated: nothing to record


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bpe")
    build_bpe_tokenizer(BPE_CORPUS, chat_template=TOOLS_TEMPLATE).save_pretrained(path)
    return path


def spelled(tokenizer, text: str) -> list[int]:
    """`text` one character at a time: a tokenization of it, not the BPE's own (merged) one."""
    return [i for c in text for i in tokenizer.encode(c, add_special_tokens=False)]


async def test_a_turn_sampled_as_another_tokenization_keeps_its_ids(bpe_dir):
    tokenizer = AutoTokenizer.from_pretrained(bpe_dir)
    sampled = spelled(tokenizer, REPLY)
    assert sampled != tokenizer.encode(REPLY, add_special_tokens=False)  # BPE merges it
    engine = ScriptedEngine(bpe_dir, lambda prompt: REPLY,
                            spell=functools.partial(spelled, tokenizer))
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=32)
    (group,) = await run_episodes(engine, envs.ChatCounter, [chat_task()], sampling)
    for record in group:
        assert record.failure is None and len(record.turns) == 3, record.failure
        sample = record.sample()
        response = sample.response_token_ids.tolist()
        assert response[:len(sampled) + 1] == sampled + [tokenizer.eos_token_id]
        conversation = [*MESSAGES, {"role": "assistant", "content": REPLY},
                        {"role": "tool", "content": "n=1."}]
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                             tokenize=False)
        context = record.prompt + response[:sample.turn_ends[0]]
        assert tokenizer.decode(context) == text  # the observation completes the rendering


async def test_a_tool_environments_tools_reach_the_chat_template(bpe_dir):
    engine = ScriptedEngine(bpe_dir, lambda prompt: "5")

    def adder():
        return envs.Adder(reward=resolve_reward("math"))

    (with_tools,) = await run_episodes(engine, adder, [chat_task()])
    prompt = engine.tokenizer.decode(with_tools[0].prompt)
    schemas = json.loads(prompt.removeprefix("<tools>").partition("\n")[0])
    assert [s["function"]["name"] for s in schemas] == ["add"]
    assert all(r.failure is None for r in with_tools)
    (without,) = await run_episodes(engine, envs.ChatCounter, [chat_task()])
    assert not engine.tokenizer.decode(without[0].prompt).startswith("<tools>")
