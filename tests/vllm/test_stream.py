"""The streaming producer on the in-process vLLM engine (`engine=vllm`, `rollout.max_in_flight`)
on the embedded bus: groups are vLLM requests of their own, and a LoRA version announced while
they run loads under `finish` (they end on their version) or `restart` (they are aborted, their
tokens counted wasted, and generated again under the new one). Every token's logprob is the
trainer's under the version it records."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from miles.bus import open_bus  # noqa: E402
from miles.engines.base import LoraSettings  # noqa: E402
from miles.engines.vllm_engine import VLLMEngine  # noqa: E402
from miles.feeder import feed  # noqa: E402
from miles.protocol import encode  # noqa: E402
from miles.protocol.topics import run_topics, topic_name  # noqa: E402
from miles.rl.sampling import SamplingParams  # noqa: E402
from miles.rollout import RolloutConfig, RolloutWorker  # noqa: E402
from miles.tasks.arithmetic import arithmetic_problems  # noqa: E402
from miles.tasks.rewards import Scorer  # noqa: E402
from miles.weights.following import FollowConfig  # noqa: E402
from miles.weights.store import base_model_id, version_dir, write_version  # noqa: E402
from tests.factories import mean_logprob_gap  # noqa: E402
from tests.integration.test_streaming_producer import published  # noqa: E402
from tests.integration.test_weight_loading import wait_for  # noqa: E402
from tests.rewards import starts_with_digit  # noqa: E402
from tests.vllm.conftest import TIER, random_adapter, trainer_model  # noqa: E402

LONG = SamplingParams(n=4, temperature=1.0, max_new_tokens=96)  # requests run a while
VERSION = {"finish": 1, "restart": 2}  # versions only go forward on the module's engine


@pytest.fixture(scope="module")
def lora_engine(vllm_model_dir):
    engine = VLLMEngine(vllm_model_dir, TIER.settings, lora=LoraSettings(r=8, alpha=16))
    yield engine
    engine.close()


@pytest.mark.parametrize("policy", ["finish", "restart"])
async def test_a_version_announced_while_requests_run(lora_engine, vllm_model_dir, tmp_path,
                                                      policy):
    version = VERSION[policy]
    before = lora_engine.policy_version
    store = tmp_path / "weights"
    record = write_version(store, policy_version=version, step=version,
                           base_model=base_model_id(vllm_model_dir),
                           write=lambda folder: random_adapter(vllm_model_dir, folder,
                                                               seed=version))
    run, fed = f"vllm-stream-{policy}", arithmetic_problems("train")[:5]
    async with open_bus("embedded://") as bus:
        await bus.create_topics(run_topics(run, prompt_partitions=1, trajectory_partitions=1))
        worker = RolloutWorker(bus, lora_engine, Scorer(starts_with_digit), RolloutConfig(
            run=run, base_model=base_model_id(vllm_model_dir), weights=FollowConfig(store=store),
            heartbeat_s=60, max_staleness=100, max_in_flight=2, weight_update=policy,
            sampling=LONG))
        stop = asyncio.Event()
        running = asyncio.create_task(worker.run(stop))
        stream = worker.stream
        try:
            await feed(bus, run, fed, shuffle=False)
            await wait_for(lambda: stream.in_flight == 2 and all(
                r.tokens >= 8 for r in stream._running), timeout_s=120)
            old = list(stream._running)
            await bus.publish(topic_name(run, "control"), encode(record))
            await wait_for(lambda: lora_engine.policy_version == version, timeout_s=60)
            overlap = sum(not r.future.done() for r in old)  # still running at the load
            await wait_for(lambda: worker.counts["producer/groups"] == len(fed), timeout_s=240)
        finally:
            stop.set()
            await asyncio.wait_for(running, 60)
        groups = await published(bus, run, len(fed))
    extras = stream.extras()
    versions = [set(s.versions.tolist()) for g in groups for s in g.samples]
    assert all(len(v) == 1 for v in versions) and extras["mixed_sample_share"] == 0
    assert {next(iter(v)) for v in versions} <= {before, version}
    assert lora_engine.policy_version == version
    assert sorted(g.task_id for g in groups) == sorted(p.task_id for p in fed)
    assert 0 < extras["busy_fraction"] <= 1 and extras["generated_tokens_per_s"] > 0
    assert "first_token_after_version_s" in extras
    if policy == "finish":  # the requests running at the announcement ended on their version
        assert overlap >= 1, "the requests ended before the version landed: make them longer"
        assert {r.served.policy_version for r in old} == {before}
        assert sum(v == {before} for v in versions) >= len(old) * LONG.n
        assert {version} in versions
        assert extras["tokens_wasted"] == 0 and extras["restarted_groups"] == 0
    else:  # they were aborted and generated again under the new version
        assert 1 <= extras["restarted_groups"] <= len(old)
        assert extras["tokens_wasted"] >= 8 * extras["restarted_groups"]
        assert sum(v == {version} for v in versions) >= extras["restarted_groups"] * LONG.n
    assert_trainers_logprobs(groups, vllm_model_dir,
                             {before: None, version: version_dir(store, version)})


def assert_trainers_logprobs(groups, model_dir, adapters: dict) -> None:
    """Each sample's logprobs are the trainer's under the version its tokens record."""
    for version, adapter in adapters.items():
        mine = [(g.prompt_token_ids.tolist(), [SimpleNamespace(
            token_ids=s.response_token_ids, logprobs=s.logprobs, finish_reason=s.finish_reason)
            for s in g.samples if s.versions[0] == version]) for g in groups]
        mine = [(p, c) for p, c in mine if c][:2]
        if not mine or (version != 0 and adapter is None):
            continue
        model = trainer_model(model_dir, adapter if version else None)
        gap = mean_logprob_gap(model, [p for p, _ in mine], [c for _, c in mine], LONG)
        assert gap <= TIER.logprob_tolerance, (version, gap)
