"""A producer rejects every broken weight version with a log line and a status event, and
keeps generating with the weights it has (embedded bus, real adapters)."""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from dataclasses import replace

import pytest

from miles.bus import open_bus
from miles.engines.base import LoraSettings
from miles.engines.hf import HFEngine
from miles.errors import EngineError, EngineUnavailableError
from miles.feeder import feed
from miles.protocol import Heartbeat, decode, encode
from miles.protocol.topics import run_topics, topic_name
from miles.rl.sampling import SamplingParams
from miles.rollout import RolloutConfig, RolloutWorker
from miles.tasks.arithmetic import arithmetic_problems
from miles.tasks.rewards import Scorer
from miles.trainer import distributed
from miles.trainer.learner import Learner
from miles.weights import follower
from miles.weights.following import FollowConfig
from miles.weights.store import WEIGHTS_FILES, base_model_id, version_dir, write_version
from tests.rewards import starts_with_digit

LORA = LoraSettings(r=4, alpha=8)


@pytest.fixture(scope="module")
def versions(model_dir, tmp_path_factory):
    """Real adapters as versions 1 to 7 of a weight store (one export, copied)."""
    store = tmp_path_factory.mktemp("weights")
    learner = Learner(model_dir, lora=LORA)
    base = base_model_id(model_dir)
    records = {v: write_version(store, policy_version=v, step=v, base_model=base,
                                write=learner.export_weights) for v in range(1, 8)}
    distributed.destroy()
    return store, records


async def wait_for(predicate, timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_every_broken_version_is_rejected_and_generation_goes_on(model_dir, versions,
                                                                       caplog):
    store, records = versions
    adapter = version_dir(store, 4) / WEIGHTS_FILES["lora"]
    adapter.write_bytes(adapter.read_bytes()[:-100])  # truncated after it was announced
    shutil.rmtree(version_dir(store, 3))  # missing
    broken = [
        replace(records[2], sha256="0" * 64),  # wrong sha256
        records[3], records[4],
        replace(records[5], base_model="another-model"),  # an adapter for another base
        replace(records[1], policy_version=0),  # going backwards from version 1, loaded
    ]
    run = "loading"
    async with open_bus("embedded://") as bus:
        await bus.create_topics(run_topics(run, prompt_partitions=1, trajectory_partitions=1))
        engine = HFEngine(model_dir, lora=LORA)
        worker = RolloutWorker(bus, engine, Scorer(starts_with_digit), RolloutConfig(
            run=run, heartbeat_s=60, base_model=base_model_id(model_dir),
            weights=FollowConfig(store=store)))
        stop = asyncio.Event()
        running = asyncio.create_task(worker.run(stop))
        control = topic_name(run, "control")
        try:
            await bus.publish(control, encode(records[1]))
            await wait_for(lambda: engine.policy_version == 1)
            for n, record in enumerate(broken, start=1):
                await bus.publish(control, encode(record))
                await wait_for(lambda: worker.counts["producer/weight_errors"] == n)
                assert engine.policy_version == 1
            await bus.publish(control, encode(records[6]))  # a good version still loads
            await wait_for(lambda: engine.policy_version == 6)
        finally:
            stop.set()
            await asyncio.wait_for(running, 30)
        async with bus.consumer([topic_name(run, "status")], group_id="audit") as audit:
            beats = [decode(r.value, Heartbeat) for r in await audit.poll(timeout_s=1)]
    errors = [b.extra["error"] for b in beats if "error" in b.extra]
    assert len(errors) == 5 and all(e.startswith(f"version {v}: ") for e, v in
                                    zip(errors, [2, 3, 4, 5, 0]))
    assert "sha256" in errors[0] and "does not exist" in errors[1]
    assert "bytes, announced" in errors[2] and "another-model" in errors[3]
    assert "versions only go forward" in errors[4]
    assert sum("rejected" in r.message for r in caplog.records) == 5
    assert worker.counts["producer/weight_loads"] == 2 and worker.counts["producer/load_s"] > 0
    assert len(worker.follower.load_latencies) == 2  # announced -> in use, for each load


class SlowEngine(HFEngine):
    """Each generate takes at least `GENERATE_S`, so a version announced meanwhile waits."""

    GENERATE_S = 1.0
    generating = threading.Event()

    def generate(self, prompts, params, *, seed=None):
        self.generating.set()
        time.sleep(self.GENERATE_S)
        return super().generate(prompts, params, seed=seed)


async def test_load_time_counts_the_load_not_the_wait_behind_a_generate(model_dir, versions):
    store, records = versions
    run = "waiting"
    async with open_bus("embedded://") as bus:
        await bus.create_topics(run_topics(run, prompt_partitions=1, trajectory_partitions=1))
        await feed(bus, run, arithmetic_problems("train")[:2], shuffle=False)
        engine = SlowEngine(model_dir, lora=LORA)
        worker = RolloutWorker(bus, engine, Scorer(starts_with_digit), RolloutConfig(
            run=run, sampling=SamplingParams(n=1, max_new_tokens=2), prompts_per_batch=2,
            max_staleness=1000, heartbeat_s=60, weights=FollowConfig(store=store)))
        stop = asyncio.Event()
        running = asyncio.create_task(worker.run(stop))
        try:
            await asyncio.to_thread(engine.generating.wait, 30)
            announced = time.perf_counter()
            await bus.publish(topic_name(run, "control"), encode(records[1]))
            await wait_for(lambda: engine.policy_version == 1)
            waited = time.perf_counter() - announced
        finally:
            stop.set()
            await asyncio.wait_for(running, 30)
    assert worker.counts["producer/weight_loads"] == 1
    assert 0 < worker.counts["producer/load_s"] < SlowEngine.GENERATE_S / 2 < waited


class UnreachableEngine(HFEngine):
    """An engine behind a server that is down while `down` is set: every load fails as
    unreachable (`EngineUnavailableError`), as a vLLM server's does while it restarts; a
    version in `refused` is refused by the server (a plain EngineError)."""

    down = True
    refused: set[int] = set()
    tried: list[int] = []

    def load_adapter(self, adapter_dir, policy_version, *, new_lineage=False):
        self.tried.append(policy_version)
        if self.down:
            raise EngineUnavailableError("POST /v1/load_lora_adapter: connection refused")
        if policy_version in self.refused:
            raise EngineError(f"cannot load adapter v{policy_version}: HTTP 400")
        return super().load_adapter(adapter_dir, policy_version, new_lineage=new_lineage)


async def test_a_version_announced_while_the_engine_is_unreachable_loads_once_it_is_back(
        model_dir, versions, monkeypatch):
    """A server down for a restart says nothing about the versions: the newest is reported
    once, kept and retried every WEIGHT_RETRY_S (not the older ones behind it, which would fail
    alike), and loaded when the server answers again (it was dropped for good, and the producer
    waited for it forever: the vLLM tier's server-restart run hung at 'loaded 2'). A version
    the server refuses is still dropped."""
    monkeypatch.setattr(follower, "WEIGHT_RETRY_S", 0.5)
    store, records = versions
    run = "unreachable"
    async with open_bus("embedded://") as bus:
        await bus.create_topics(run_topics(run, prompt_partitions=1, trajectory_partitions=1))
        engine = UnreachableEngine(model_dir, lora=LORA)
        engine.tried, engine.refused = [], {7}  # 3 to 5 are broken by the first test
        worker = RolloutWorker(bus, engine, Scorer(starts_with_digit), RolloutConfig(
            run=run, heartbeat_s=60, weights=FollowConfig(store=store)))
        stop = asyncio.Event()
        running = asyncio.create_task(worker.run(stop))
        control = topic_name(run, "control")
        try:
            await bus.publish(control, encode(records[1]))
            await wait_for(lambda: worker.counts["producer/weight_errors"] == 1)
            await bus.publish(control, encode(records[2]))
            await wait_for(lambda: worker.counts["producer/weight_errors"] == 2)
            await asyncio.sleep(1.3)  # two or three retries while it is down, reported once
            assert engine.policy_version == 0 and worker.counts["producer/weight_errors"] == 2
            assert 3 <= engine.tried.count(2) <= 5 and engine.tried.count(1) == 1, engine.tried
            assert worker.follower.failures() == ("versions 2, 1 failed to load, retried "
                                                  "every 0.5 s")
            engine.down = False
            await wait_for(lambda: engine.policy_version == 2)
            await bus.publish(control, encode(records[7]))  # refused: dropped, never retried
            await wait_for(lambda: worker.counts["producer/weight_errors"] == 3)
            await asyncio.sleep(1.2)
            assert engine.tried.count(7) == 1 and worker.follower.failures() is None
        finally:
            stop.set()
            await asyncio.wait_for(running, 30)
    assert worker.counts["producer/weight_loads"] == 1 and engine.policy_version == 2
