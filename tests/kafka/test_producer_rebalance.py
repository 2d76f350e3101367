"""Producers on the real broker through consumer-group membership changes: a third member
joining and leaving, and a producer stopping gracefully. No producer dies, every prompt's group
arrives, and a revocation commits what was published (waiting for the batch in flight), so
these graceful changes duplicate nothing. Both with batches and streaming (`max_in_flight`:
groups in flight on revoked partitions finish first, the commit is each partition's lowest
prompt in flight)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest

from miles.bus import open_bus
from miles.engines.base import LoraSettings
from miles.engines.hf import HFEngine
from miles.feeder import feed
from miles.protocol import TrajectoryGroup, decode
from miles.protocol.topics import run_topics, topic_name
from miles.rl.sampling import SamplingParams
from miles.rollout import RolloutConfig, RolloutWorker
from miles.tasks.arithmetic import arithmetic_problems
from miles.tasks.rewards import Scorer
from tests.conftest import unique_run
from tests.rewards import starts_with_digit

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


class SlowEngine(HFEngine):
    """Each generate takes at least `GENERATE_S`: a rebalance finds batches in flight."""

    GENERATE_S = 0.5

    def generate(self, prompts, params, *, seed=None):
        time.sleep(self.GENERATE_S)
        return super().generate(prompts, params, seed=seed)


class SlowStepEngine(HFEngine):
    """Each decoding step of its continuous batcher takes at least `STEP_S`: a group of 12
    tokens is in flight for seconds, longer than a rebalance takes to reach the members."""

    STEP_S = 0.2

    def streaming_sampler(self):
        sampler = super().streaming_sampler()
        if not getattr(sampler, "slowed", False):
            step = sampler.step

            def slow_step():
                time.sleep(self.STEP_S)
                return step()

            sampler.step, sampler.slowed = slow_step, True
        return sampler


class Producers:
    """In-process rollout workers sharing one bus, each with its own engine and stop event."""

    def __init__(self, bus, run: str, model_dir, mode: str):
        self.bus, self.run, self.model_dir, self.mode = bus, run, model_dir, mode
        self.stops: dict[str, asyncio.Event] = {}
        self.tasks: dict[str, asyncio.Task] = {}

    def start(self, name: str) -> None:
        lora = LoraSettings(r=4, alpha=8)
        if self.mode == "stream":  # groups of 12 tokens: a rebalance finds several in flight
            engine = SlowStepEngine(self.model_dir, lora=lora)
            sampling, streaming = SamplingParams(n=2, max_new_tokens=12), {"max_in_flight": 3}
        else:
            engine = SlowEngine(self.model_dir, lora=lora)
            sampling, streaming = SamplingParams(n=1, max_new_tokens=2), {}
        worker = RolloutWorker(self.bus, engine, Scorer(starts_with_digit), RolloutConfig(
            run=self.run, producer_id=name, sampling=sampling, prompts_per_batch=2,
            max_staleness=1000, heartbeat_s=60, **streaming))
        self.stops[name] = asyncio.Event()
        self.tasks[name] = asyncio.create_task(worker.run(self.stops[name]))

    async def stop(self, name: str) -> None:
        self.stops[name].set()
        await asyncio.wait_for(self.tasks[name], 60)  # raises what ended it, if anything

    def check_alive(self) -> None:
        for name, task in self.tasks.items():
            if task.done() and not self.stops[name].is_set():
                task.result()  # raises the error that ended this producer
                raise AssertionError(f"{name} stopped on its own")


async def read_groups(audit, groups: list, until, producers: Producers, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while not until() and time.monotonic() < deadline:
        producers.check_alive()
        groups.extend(decode(r.value, TrajectoryGroup) for r in await audit.poll(timeout_s=0.3))


async def run_producers(kafka_broker, model_dir, prompts: int, change,
                        mode: str) -> list[TrajectoryGroup]:
    """Feed `prompts`, run producers a and b, `await change(...)` while they work, and return
    every group published once all prompts arrived and the topic went quiet."""
    run = unique_run()
    fed = arithmetic_problems("train")[:prompts]
    async with open_bus(kafka_broker.url) as bus:
        await bus.create_topics(run_topics(run, prompt_partitions=4, trajectory_partitions=1))
        await feed(bus, run, fed)
        producers = Producers(bus, run, model_dir, mode)
        groups: list[TrajectoryGroup] = []
        async with bus.consumer([topic_name(run, "trajectories")], group_id="audit") as audit:
            try:
                producers.start("producer-a")
                producers.start("producer-b")
                await change(bus, run, producers, audit, groups)
                await read_groups(audit, groups, lambda: len({g.task_id for g in groups})
                                  == prompts, producers, 180)
                await read_groups(audit, groups, lambda: False, producers, 3.0)  # stragglers
                producers.check_alive()
            finally:
                for name in producers.tasks:
                    await producers.stop(name)
    assert {g.task_id for g in groups} == {p.task_id for p in fed}
    return groups


def duplicated(groups: list[TrajectoryGroup]) -> int:
    return sum(n - 1 for n in Counter(g.task_id for g in groups).values())


@pytest.mark.parametrize("mode", ["batch", "stream"])
async def test_members_joining_and_leaving_neither_kill_producers_nor_lose_prompts(
        kafka_broker, model_dir, mode):
    async def churn(bus, run, producers, audit, groups) -> None:
        for _ in range(3):
            await read_groups(audit, groups, lambda: False, producers, 1.5)
            third = bus.consumer([topic_name(run, "prompts")],
                                 group_id=f"miles.{run}.producers")
            await third.start()  # joins: every member's partitions are revoked, then assigned
            await read_groups(audit, groups, lambda: False, producers, 1.5)
            await third.close()  # leaves: another rebalance

    groups = await run_producers(kafka_broker, model_dir, 60, churn, mode)
    assert duplicated(groups) == 0, Counter(g.task_id for g in groups).most_common(3)


@pytest.mark.parametrize("mode", ["batch", "stream"])
async def test_a_producer_leaving_gracefully_duplicates_nothing(kafka_broker, model_dir, mode):
    async def leave(bus, run, producers, audit, groups) -> None:
        await read_groups(audit, groups, lambda: Counter(
            g.producer_id for g in groups)["producer-a"] >= 4, producers, 60)
        await producers.stop("producer-a")

    groups = await run_producers(kafka_broker, model_dir, 40, leave, mode)
    by_producer = Counter(g.producer_id for g in groups)
    assert by_producer["producer-a"] >= 4 and by_producer["producer-b"] > 0
    assert duplicated(groups) == 0, Counter(g.task_id for g in groups).most_common(3)
