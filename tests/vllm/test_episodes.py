"""Multi-turn episodes on the real vLLM, in process (engine "vllm") and as a server
("vllm-server"): three turns with stop strings, every ready episode's turn in one engine call,
the engine's logprobs equal to the trainer's teacher-forced ones over the policy tokens of the
whole multi-turn context, and episodes that outgrow max_model_len end at it ("max_context")
instead of failing the batch (vLLM refuses prompt + max_tokens > max_model_len). With
`episodes.stream_turns` each turn is a concurrent request of its own, with the same guarantees."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from miles.engines.vllm_engine import VLLMEngine  # noqa: E402
from miles.engines.vllm_server import VLLMServerEngine  # noqa: E402
from miles.episodes import EpisodeRunner, EpisodeSettings  # noqa: E402
from miles.errors import EngineRejectedError  # noqa: E402
from miles.protocol import PromptTask  # noqa: E402
from miles.rl.sampling import SamplingParams, sampled_logprobs  # noqa: E402
from tests import envs  # noqa: E402
from tests.vllm.conftest import MAX_MODEL_LEN, TIER, trainer_model  # noqa: E402

SAMPLING = SamplingParams(n=2, temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=12)
PROMPTS = ("2+2=", "The answer:")
LONG = EpisodeSettings(max_turns=50, max_total_tokens=400)  # only the context ends these
WAIT_S = 600.0


@pytest.fixture(scope="module")
def engine(vllm_model_dir):
    engine = VLLMEngine(vllm_model_dir, TIER.settings, lora=None)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def trainer(vllm_model_dir):
    return trainer_model(vllm_model_dir)


def tasks(**metadata) -> list[PromptTask]:
    return [PromptTask(task_id=f"t{i}", prompt=p, metadata={"name": f"t{i}", **metadata},
                       created_at=0.0) for i, p in enumerate(PROMPTS)]


async def run_episodes(engine, factory, prompt_tasks, settings=EpisodeSettings(), calls=None):
    async def generate(prompts, params, **kwargs):
        if calls is not None:
            calls.append((prompts, params, kwargs))
        return await asyncio.to_thread(engine.generate, prompts, params, **kwargs)

    runner = EpisodeRunner(engine, factory, settings, SAMPLING, generate_in_engine=generate)
    prompts = [(t, engine.encode(t.prompt)) for t in prompt_tasks]
    records = await asyncio.wait_for(runner.run(prompts, seed=1), WAIT_S)
    return [r for group in records for r in group]


def policy_logprob_gap(model, records) -> float:
    """Mean |engine - trainer| over every policy token of `records`, the trainer's from one
    teacher-forced forward over each episode's whole context (observations included)."""
    gaps = []
    for record in records:
        sample = record.sample()
        ids = torch.tensor([record.prompt + sample.response_token_ids.tolist()])
        with torch.inference_mode():
            logits = model(ids.to(next(model.parameters()).device)).logits[
                0, len(record.prompt) - 1:-1]  # [T, V]
        ours = sampled_logprobs(logits, ids[0, len(record.prompt):].to(logits.device),
                                temperature=SAMPLING.temperature, top_k=SAMPLING.top_k,
                                top_p=SAMPLING.top_p).cpu().numpy()
        policy = sample.loss_mask == 1
        gaps.append(np.abs(ours[policy] - sample.logprobs[policy]))
    return float(np.concatenate(gaps).mean())


def check_three_turns(engine, records, calls, trainer) -> None:
    assert len(records) == len(PROMPTS) * SAMPLING.n
    assert all(r.failure is None and len(r.turns) == 3 for r in records), [
        r.failure for r in records]
    assert [len(prompts) for prompts, *_ in calls] == [4, 4, 4]  # a round: one engine call
    assert all(kwargs["stop_strings"] == envs.StopCounter.stop_strings for *_, kwargs in calls)
    reasons = [t.completion.finish_reason for r in records for t in r.turns]
    assert "stop_string" in reasons, reasons
    for turn in (t for r in records for t in r.turns):
        if turn.completion.finish_reason == "stop_string":  # the stop string is kept
            text = engine.decode(turn.completion.token_ids)
            assert any(s in text for s in envs.StopCounter.stop_strings), text
    gap = policy_logprob_gap(trainer, records)
    assert gap <= TIER.logprob_tolerance, gap


async def check_streamed_turns(engine, trainer) -> None:
    """Each turn one engine call (not through the rounds' `generate_in_engine`), every episode
    three turns, the logprobs the trainer's."""
    calls = []
    records = await run_episodes(engine, envs.StopCounter, tasks(),
                                 EpisodeSettings(stream_turns=True), calls)
    assert calls == []  # no round: the turns went to the engine one by one
    assert all(r.failure is None and len(r.turns) == 3 for r in records), [
        r.failure for r in records]
    gap = policy_logprob_gap(trainer, records)
    assert gap <= TIER.logprob_tolerance, gap


def check_context_bound(records, calls) -> None:
    for prompts, params, _ in calls:  # what vLLM validates
        assert all(len(p) + params.max_new_tokens <= MAX_MODEL_LEN for p in prompts)
    for record in records:
        assert record.failure is None and record.truncated == "max_context", record.failure
        assert len(record.prompt) + len(record.sample().response_token_ids) <= MAX_MODEL_LEN


async def test_episodes_on_the_in_process_engine(engine, trainer):
    assert engine.context_limit == MAX_MODEL_LEN
    calls = []
    check_three_turns(engine, await run_episodes(engine, envs.StopCounter, tasks(),
                                                 calls=calls), calls, trainer)
    calls = []
    check_context_bound(await run_episodes(engine, envs.Counter, tasks(turns=50), LONG, calls),
                        calls)
    await check_streamed_turns(engine, trainer)


async def test_a_request_vllm_refuses_fails_its_episode_only(engine, monkeypatch):
    """The auditor's case without the runner's cap: vLLM refuses a prompt that fills
    max_model_len (in process it caps max_tokens to the room left; the server refuses prompt +
    max_tokens past it); that episode fails ("engine_rejected"), the other plays on."""
    long_prompt = engine.encode("1234567890" * 13)[:MAX_MODEL_LEN]
    assert len(long_prompt) == MAX_MODEL_LEN
    with pytest.raises(EngineRejectedError, match="maximum model length"):
        engine.generate([long_prompt], SAMPLING)
    monkeypatch.setattr(VLLMEngine, "context_limit", property(lambda self: None))
    short, long = tasks(turns=1)
    runner = EpisodeRunner(engine, envs.Counter, EpisodeSettings(), SAMPLING,
                           generate_in_engine=lambda *a, **k: asyncio.to_thread(
                               engine.generate, *a, **k))
    records = await asyncio.wait_for(runner.run(
        [(short, engine.encode(short.prompt)), (long, long_prompt)], seed=0), WAIT_S)
    assert all(r.failure is None and len(r.turns) == 1 for r in records[0])
    assert all(r.failure_kind == "engine_rejected" for r in records[1])


async def test_episodes_on_the_server(vllm_server, vllm_model_dir, trainer):
    engine = VLLMServerEngine(vllm_server.url, "", vllm_model_dir, lora=False, timeout_s=300.0)
    assert engine.context_limit == MAX_MODEL_LEN  # from the server's /v1/models
    calls = []
    check_three_turns(engine, await run_episodes(engine, envs.StopCounter, tasks(),
                                                 calls=calls), calls, trainer)
    calls = []
    check_context_bound(await run_episodes(engine, envs.Counter, tasks(turns=50), LONG, calls),
                        calls)
    await check_streamed_turns(engine, trainer)
