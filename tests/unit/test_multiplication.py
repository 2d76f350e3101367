"""The multiplication-with-a-calculator task: disjoint, reproducible splits, and a warm start
whose pairs concatenate to exactly the episode the calculator environment rewards, as the
producer's runner builds it (scripted engine on the chat tokenizer)."""

from __future__ import annotations

import asyncio

import pytest

from miles.envs import load_environment
from miles.episodes import EpisodeRunner, EpisodeSettings
from miles.protocol import PromptTask
from miles.rl.sampling import SamplingParams
from miles.tasks.multiplication import multiplication_problems, warm_start_problems
from miles.tasks.rewards import resolve_reward
from miles.tasks.tiny_model import build_char_tokenizer
from tests.scripted import ScriptedEngine

MAX_POSITIONS = 64  # the tiny model's context


def test_splits_are_disjoint_and_reproducible():
    train, test = multiplication_problems("train"), multiplication_problems("test")
    assert len(test) == 500 and len(train) == 90 * 90 - 500
    assert not {p.prompt for p in train} & {p.prompt for p in test}
    assert multiplication_problems("test") == test
    assert all(int(p.answer) == eval(p.prompt[:-1]) for p in test[:50])  # noqa: S307 (digits)
    with pytest.raises(ValueError, match="split"):
        multiplication_problems("dev")


async def test_the_warm_start_is_the_rewarded_episode(tmp_path):
    build_char_tokenizer(chat=True).save_pretrained(tmp_path)
    problems = multiplication_problems("test")[:4]
    pairs = warm_start_problems(problems)
    assert len(pairs) == 2 * len(problems)
    said = {pair.prompt: pair.answer for pair in pairs}
    engine = ScriptedEngine(tmp_path, lambda prompt: said[prompt])
    scorer = resolve_reward("exact_match")

    async def generate(prompts, params, **kwargs):
        return engine.generate(prompts, params, **kwargs)

    runner = EpisodeRunner(engine, load_environment("calculator", reward=scorer),
                           EpisodeSettings(), SamplingParams(n=1, max_new_tokens=40),
                           generate_in_engine=generate)
    tasks = [(PromptTask(task_id=p.task_id, prompt=p.prompt, reference=p.answer, created_at=0.0),
              engine.encode(p.prompt)) for p in problems]
    records = await asyncio.wait_for(runner.run(tasks, seed=0), 60)
    for problem, (record,), answer_pair in zip(problems, records, pairs[1::2]):
        sample = record.sample()
        assert record.failure is None and sample.reward == 1.0 and record.tool_calls == 1
        episode = record.prompt + sample.response_token_ids.tolist()
        # SFT's second pair (prompt + call + result -> product, then EOS) is the episode
        assert episode == engine.encode(answer_pair.prompt + answer_pair.answer) + [
            engine.eos_token_id]
        assert len(episode) <= MAX_POSITIONS
        assert sample.loss_mask.tolist().count(0) == len(engine.encode(
            f"<result>{problem.answer}</result>"))
