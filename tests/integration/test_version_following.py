"""Which announced versions a producer follows: the newest trainer generation's, going forward
within one generation; a fenced (older) generation's versions and heartbeats are ignored
(embedded bus, real adapters)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from miles.bus import open_bus
from miles.engines.base import LoraSettings
from miles.engines.hf import HFEngine
from miles.feeder import feed
from miles.protocol import Heartbeat, decode, encode
from miles.protocol.topics import run_topics, topic_name
from miles.rl.sampling import SamplingParams
from miles.rollout import RolloutConfig, RolloutWorker
from miles.status import collect_status, format_status
from miles.tasks.arithmetic import arithmetic_problems
from miles.tasks.rewards import Scorer
from miles.weights import follower
from miles.weights.following import FollowConfig
from miles.weights.store import base_model_id, version_dir
from tests.integration.test_weight_loading import versions, wait_for  # noqa: F401 (fixture)
from tests.rewards import starts_with_digit

LORA = LoraSettings(r=4, alpha=8)




def trainer_beat(policy_version: int, generation: int, consumed: int = 0) -> bytes:
    return encode(Heartbeat(producer_id="trainer", role="trainer", engine="fsdp2",
                            policy_version=policy_version, trainer_generation=generation,
                            extra={"consumed": consumed}, created_at=time.time()))


async def started_worker(bus, run, model_dir, store, **settings):
    await bus.create_topics(run_topics(run, prompt_partitions=1, trajectory_partitions=1))
    engine = HFEngine(model_dir, lora=LORA)
    worker = RolloutWorker(bus, engine, Scorer(starts_with_digit), RolloutConfig(
        run=run, base_model=base_model_id(model_dir), weights=FollowConfig(store=store),
        **{"heartbeat_s": 60, **settings}))
    stop = asyncio.Event()
    return engine, worker, stop, asyncio.create_task(worker.run(stop))


async def test_a_resumed_trainer_is_followed_and_a_fenced_one_ignored(model_dir, versions):
    store, records = versions
    run = "lineage"
    async with open_bus("embedded://") as bus:
        engine, worker, stop, running = await started_worker(bus, run, model_dir, store)
        control, status = topic_name(run, "control"), topic_name(run, "status")

        async def announce(version: int, generation: int) -> None:
            await bus.publish(control, encode(replace(records[version],
                                                      trainer_generation=generation)))

        try:
            for v in (1, 2, 3):
                await announce(v, generation=1)
                await wait_for(lambda: worker.counts["producer/weight_loads"] == v)
            await announce(3, generation=2)  # resumed from its version-3 checkpoint
            await wait_for(lambda: worker.counts["producer/weight_loads"] == 4)
            await announce(2, generation=3)  # resumed from an older checkpoint
            await wait_for(lambda: worker.counts["producer/weight_loads"] == 5)
            assert engine.policy_version == 2 and worker.trainer.policy_version == 2
            await announce(5, generation=2)  # the fenced trainer of generation 2
            await wait_for(lambda: worker.counts["producer/weight_errors"] == 1)
            await announce(1, generation=3)  # backwards within one generation
            await wait_for(lambda: worker.counts["producer/weight_errors"] == 2)
            await announce(2, generation=3)  # a re-announcement is no error
            await asyncio.sleep(0.5)
            assert worker.counts["producer/weight_errors"] == 2
            assert engine.policy_version == 2 and worker.trainer.policy_version == 2

            await bus.publish(status, trainer_beat(9, generation=2, consumed=50))  # ignored
            await bus.publish(status, trainer_beat(4, generation=3, consumed=7))
            await wait_for(lambda: worker.trainer.consumed == 7)
            assert worker.trainer.policy_version == 4
            await bus.publish(status, trainer_beat(1, generation=4, consumed=3))
            await wait_for(lambda: worker.trainer.consumed == 3)
            assert worker.trainer.policy_version == 1  # a newer generation resets the view
            await announce(6, generation=3)  # generation 4 fenced generation 3
            await wait_for(lambda: worker.counts["producer/weight_errors"] == 3)
            assert engine.policy_version == 2
        finally:
            stop.set()
            await asyncio.wait_for(running, 30)
        async with bus.consumer([status], group_id="audit") as audit:
            beats = [decode(r.value, Heartbeat) for r in await audit.poll(timeout_s=1)]
    errors = [b.extra["error"] for b in beats if "error" in b.extra]
    assert len(errors) == 3
    assert errors[0].startswith("version 5: ") and "generation 2" in errors[0]
    assert "fenced by generation 3" in errors[0]
    assert "versions only go forward" in errors[1]
    assert "fenced by generation 4" in errors[2]


async def test_a_missing_newest_file_falls_back_and_admission_says_what_it_waits_for(
        model_dir, versions, monkeypatch):
    monkeypatch.setattr(follower, "WEIGHT_RETRY_S", 0.3)
    store, records = versions
    run = "fallback"
    hidden = {v: version_dir(store, v).with_name(f"hidden-{v}") for v in (5, 6)}
    for v, path in hidden.items():
        version_dir(store, v).rename(path)
    try:
        async with open_bus("embedded://") as bus:
            engine, worker, stop, running = await started_worker(
                bus, run, model_dir, store, sampling=SamplingParams(n=1, max_new_tokens=2),
                prompts_per_batch=2, max_staleness=1, heartbeat_s=0.1)
            control = topic_name(run, "control")
            try:
                for v in range(1, 6):  # the newest, 5, has no file
                    await bus.publish(control, encode(records[v]))
                await feed(bus, run, arithmetic_problems("train")[:4], shuffle=False)
                await wait_for(lambda: worker.counts["producer/groups"] == 4)
                assert engine.policy_version == 4 and worker.counts["producer/weight_errors"] == 1
                await bus.publish(control, encode(records[6]))
                await wait_for(lambda: worker.counts["producer/weight_errors"] == 2)
                assert worker.trainer.policy_version == 4  # a version that did not load
                await bus.publish(topic_name(run, "status"), trainer_beat(6, generation=0))
                await wait_for(lambda: worker.trainer.policy_version == 6)  # needs >= 5
                await wait_for(lambda: worker.waiting is not None)
                await feed(bus, run, arithmetic_problems("train")[4:6], shuffle=False)
                await asyncio.sleep(1.0)  # several retries: reported once each, no groups
                assert worker.counts["producer/weight_errors"] == 2
                assert worker.counts["producer/groups"] == 4 and engine.policy_version == 4
                blocked = format_status(await collect_status(bus, run))
                hidden.pop(6).rename(version_dir(store, 6))  # the file reappears
                await wait_for(lambda: engine.policy_version == 6)
                await wait_for(lambda: worker.counts["producer/groups"] == 6)
                assert worker.waiting is None
            finally:
                stop.set()
                await asyncio.wait_for(running, 30)
            async with bus.consumer([topic_name(run, "status")], group_id="audit") as audit:
                beats = [decode(r.value, Heartbeat) for r in await audit.poll(timeout_s=1)]
    finally:
        for v, path in hidden.items():
            path.rename(version_dir(store, v))
    waits = {b.extra["waiting"] for b in beats if "waiting" in b.extra}
    assert waits == {"policy version >= 5 (loaded 4); versions 6, 5 failed to load, retried "
                     "every 0.3 s"}, waits
    assert "producer-0: waiting for policy version >= 5 (loaded 4)" in blocked, blocked


async def test_the_evaluator_follows_a_resumed_trainer_and_ignores_a_fenced_one(model_dir,
                                                                               versions):
    from miles.evaluation import Evaluator

    store, records = versions
    run = "evaluated"
    async with open_bus("embedded://") as bus:
        await bus.create_topics(run_topics(run, prompt_partitions=1, trajectory_partitions=1))
        control, status = topic_name(run, "control"), topic_name(run, "status")

        async def announce(version: int, generation: int) -> int:
            await bus.publish(control, encode(replace(records[version],
                                                      trainer_generation=generation)))
            await evaluator.read_topics()
            loaded = await evaluator.load_newest()
            return evaluator.engine.policy_version if loaded else None

        async with Evaluator(bus, run, model_dir, LORA, [], every_s=60,
                             weights=FollowConfig(store=store)) as evaluator:
            assert [await announce(v, generation=1) for v in (1, 3, 2)] == [1, 3, None]
            assert await announce(2, generation=2) == 2  # resumed from an older checkpoint
            assert await announce(6, generation=1) is None  # the fenced trainer
            assert evaluator.engine.policy_version == 2
            assert await announce(4, generation=2) == 4
            await bus.publish(status, trainer_beat(1, generation=3))  # a newer trainer started
            assert await announce(5, generation=2) is None
            assert evaluator.engine.policy_version == 4 and evaluator.announced == 4


async def test_the_evaluator_returns_while_versions_keep_coming(model_dir, versions):
    """A trainer announcing faster than the evaluator's poll wait must not keep `read_topics`
    reading forever: it takes what is there and returns (a Kafka demo's clock once waited 27 s
    for it, and its run overran its max_seconds by as much)."""
    from miles.evaluation import Evaluator

    store, records = versions
    run = "busy"
    async with open_bus("embedded://") as bus:
        await bus.create_topics(run_topics(run, prompt_partitions=1, trajectory_partitions=1))
        control = topic_name(run, "control")
        stop = asyncio.Event()

        async def announce_every(seconds: float) -> None:
            while not stop.is_set():
                await bus.publish(control, encode(records[1]))
                await asyncio.sleep(seconds)

        async with Evaluator(bus, run, model_dir, LORA, [], every_s=60,
                             weights=FollowConfig(store=store)) as evaluator:
            announcing = asyncio.create_task(announce_every(0.05))
            try:
                began = time.monotonic()
                await asyncio.wait_for(evaluator.read_topics(wait_s=0.2), timeout=3.0)
                assert time.monotonic() - began < 1.0
                assert evaluator.announced == 1
            finally:
                stop.set()
                await announcing
