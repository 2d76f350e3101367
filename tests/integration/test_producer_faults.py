"""A generation failure or a refused commit neither stops the producer nor loses its prompts
(embedded bus)."""

from __future__ import annotations

import asyncio

from miles import rollout
from miles.bus import open_bus
from miles.bus.embedded import EmbeddedBus
from miles.engines.base import LoraSettings
from miles.engines.hf import HFEngine
from miles.errors import CommitFailedError, EngineError
from miles.feeder import feed
from miles.protocol import Heartbeat, TrajectoryGroup, decode
from miles.protocol.topics import run_topics, topic_name
from miles.rl.sampling import SamplingParams
from miles.rollout import RolloutConfig, RolloutWorker
from miles.tasks.arithmetic import arithmetic_problems
from miles.tasks.rewards import Scorer
from tests.rewards import starts_with_digit


class FailsOnce(HFEngine):
    """An engine whose first generate fails, like a server restarting mid-request."""

    failed = False

    def generate(self, prompts, params, *, seed=None):
        if not self.failed:
            self.failed = True
            raise EngineError("server returned HTTP 503: restarting")
        return super().generate(prompts, params, seed=seed)


async def run_until_published(worker: RolloutWorker, groups: int, *,
                              linger_s: float = 0.0) -> None:
    """Run `worker` until it has published `groups` groups (and `linger_s` more), then stop it."""
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run(stop))
    try:
        deadline = asyncio.get_running_loop().time() + 60
        while worker.counts["producer/groups"] < groups:
            assert not running.done(), running.result()
            assert asyncio.get_running_loop().time() < deadline, worker.counts
            await asyncio.sleep(0.05)
        await asyncio.sleep(linger_s)
    finally:
        stop.set()
        await asyncio.wait_for(running, 30)


async def test_a_failed_batch_is_retried_and_every_prompt_published_once(model_dir,
                                                                         monkeypatch):
    monkeypatch.setattr(rollout, "ENGINE_RETRY_S", 0.1)
    run, problems = "faults", arithmetic_problems("train")[:6]
    async with open_bus("embedded://") as bus:
        await bus.create_topics(run_topics(run, prompt_partitions=2, trajectory_partitions=1))
        await feed(bus, run, problems, shuffle=False)
        worker = RolloutWorker(bus, FailsOnce(model_dir, lora=LoraSettings(r=4, alpha=8)),
                               Scorer(starts_with_digit), RolloutConfig(
            run=run, sampling=SamplingParams(n=2, max_new_tokens=3), prompts_per_batch=4,
            max_staleness=1000, heartbeat_s=60))
        await run_until_published(worker, len(problems))
        async with bus.consumer([topic_name(run, "trajectories")], group_id="audit") as audit:
            groups = [decode(r.value, TrajectoryGroup) for r in await audit.poll(timeout_s=1)]
    assert worker.counts["producer/engine_errors"] == 1
    assert sorted(g.task_id for g in groups) == sorted(p.task_id for p in problems)


class RefusesOneCommit(EmbeddedBus):
    """The producers' group refuses its first commit, as Kafka does after a rebalance."""

    refused = 0

    def consumer(self, topics, *, group_id, **kwargs):
        inner = super().consumer(topics, group_id=group_id, **kwargs)
        if group_id.endswith(".producers"):
            original = inner.commit

            async def commit(offsets=None):
                if not self.refused:
                    self.refused += 1
                    raise CommitFailedError("committing offsets failed: CommitFailedError: "
                                            "IllegalGenerationError")
                await original(offsets)

            inner.commit = commit
        return inner


async def test_a_refused_commit_is_counted_and_the_producer_goes_on(model_dir, caplog):
    run, problems = "refused", arithmetic_problems("train")[:6]
    async with RefusesOneCommit() as bus:
        await bus.create_topics(run_topics(run, prompt_partitions=2, trajectory_partitions=1))
        await feed(bus, run, problems, shuffle=False)
        worker = RolloutWorker(bus, HFEngine(model_dir, lora=LoraSettings(r=4, alpha=8)),
                               Scorer(starts_with_digit), RolloutConfig(
            run=run, sampling=SamplingParams(n=1, max_new_tokens=2), prompts_per_batch=2,
            max_staleness=1000, heartbeat_s=0.1))
        await run_until_published(worker, len(problems), linger_s=0.3)
        async with bus.consumer([topic_name(run, "status")], group_id="audit") as audit:
            beats = [decode(r.value, Heartbeat) for r in await audit.poll(timeout_s=1)]
    assert bus.refused == 1 and beats[-1].extra["commit_failures"] == 1
    assert sum("commit refused after a rebalance" in r.message for r in caplog.records) == 1
