"""Episodes against the engine's context: the HF engine on a tiny model of 32 positions.

No engine call asks for more than the context holds (prompt plus max_new_tokens: what vLLM
refuses), an episode that fills the context ends truncated ("max_context") with a valid sample,
a first prompt that fills it fails its episode alone, and the producer warns at start-up when
`episodes.max_total_tokens` cannot fit."""

from __future__ import annotations

import asyncio
import logging

import pytest

from miles.bus.embedded import EmbeddedBus
from miles.engines import HFEngine
from miles.episodes import EpisodeRunner, EpisodeSettings
from miles.protocol import PromptTask
from miles.rl.sampling import SamplingParams
from miles.rollout import RolloutConfig, RolloutWorker
from miles.tasks.rewards import resolve_reward
from tests import envs

POSITIONS = 32
SAMPLING = SamplingParams(n=3, temperature=1.0, max_new_tokens=8)
LONG = EpisodeSettings(max_turns=50, max_total_tokens=400)  # only the context can end these
WAIT_S = 120.0


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from miles.tasks.tiny_model import build_tiny_model

    return HFEngine(build_tiny_model(tmp_path_factory.mktemp("short"), hidden_size=32, layers=1,
                                     heads=2, kv_heads=1, max_positions=POSITIONS))


def prompt_task(name: str, prompt: str, **metadata) -> PromptTask:
    return PromptTask(task_id=name, prompt=prompt, reference="5",
                      metadata={"name": name, "turns": 50, **metadata}, created_at=0.0)


async def run_episodes(engine, tasks, calls, settings=LONG):
    async def generate(prompts, params, **kwargs):
        calls.append((prompts, params))
        return await asyncio.to_thread(engine.generate, prompts, params, **kwargs)

    runner = EpisodeRunner(engine, envs.Counter, settings, SAMPLING, generate_in_engine=generate)
    prompts = [(t, engine.encode(t.prompt)) for t in tasks]
    return await asyncio.wait_for(runner.run(prompts, seed=3), WAIT_S)


def test_the_hf_engines_context_is_its_models_positions(engine):
    assert engine.context_limit == POSITIONS


async def test_episodes_end_at_the_context_and_no_call_asks_past_it(engine):
    calls = []
    records = await run_episodes(engine, [prompt_task("a", "2+3="), prompt_task("b", "12*34=")],
                                 calls)
    for prompts, params in calls:  # what vLLM validates: prompt + max_tokens <= max_model_len
        assert all(len(p) + params.max_new_tokens <= POSITIONS for p in prompts), (
            [len(p) for p in prompts], params.max_new_tokens)
    assert any(params.max_new_tokens < SAMPLING.max_new_tokens for _, params in calls)
    for group in records:
        for record in group:
            assert record.failure is None and record.truncated == "max_context"
            sample = record.sample()
            assert len(record.prompt) + len(sample.response_token_ids) <= POSITIONS
            assert sample.finish_reason == "length"
            assert sample.episode["truncated"] == "max_context"


async def test_a_prompt_that_fills_the_context_fails_its_episodes_only(engine):
    calls = []
    records = await run_episodes(engine, [prompt_task("long", "1234567890" * 4),
                                          prompt_task("short", "2+3=")], calls)
    assert all(r.failure_kind == "max_context" and not r.turns for r in records[0])
    assert "fill the engine's context of 32" in records[0][0].failure
    assert all(r.failure is None and r.turns for r in records[1])


async def test_the_producer_warns_when_max_total_tokens_cannot_fit(engine, caplog):
    bus = EmbeddedBus()
    caplog.set_level(logging.WARNING, logger="miles.rollout_groups")
    RolloutWorker(bus, engine, resolve_reward("exact_match"), RolloutConfig(), env=envs.Counter,
                  episodes=EpisodeSettings(max_total_tokens=POSITIONS))
    assert "episodes.max_total_tokens (32) plus a prompt does not fit the engine's context " \
           "(32 tokens)" in caplog.text
    caplog.clear()
    RolloutWorker(bus, engine, resolve_reward("exact_match"), RolloutConfig(), env=envs.Counter,
                  episodes=EpisodeSettings(max_total_tokens=20))
    assert "max_total_tokens" not in caplog.text
