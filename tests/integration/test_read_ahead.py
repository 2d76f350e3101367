"""The trainer collects the next step's groups while the step runs (embedded bus, a real
learner): they are judged against the version that step will make, and the heartbeat sent
after the step does not count them as consumed, so producers' admission puts their next groups
after them."""

from __future__ import annotations

import asyncio
import time

import pytest

from miles.bus import open_bus
from miles.engines.base import LoraSettings
from miles.protocol import Heartbeat, decode, encode
from miles.protocol.topics import run_topics, topic_name
from miles.trainer import distributed
from miles.trainer.learner import Learner, LearnerConfig
from miles.trainer.loop import LoopConfig, TrainerLoop
from miles.trainer.runner import StepRunner
from tests.accounting import TINY_VOCAB_SIZE, ledger
from tests.conftest import unique_run
from tests.factories import make_group


@pytest.fixture(autouse=True)
def _process_group():
    yield
    distributed.destroy()


class WatchedRunner(StepRunner):
    """A real runner whose first training step waits (at most 5 s) until the loop has
    collected a whole next batch, and notes how many groups it had."""

    loop: TrainerLoop
    collected_during_step: int | None = None

    def step(self, payload: bytes, groups=None):
        if payload and groups and self.collected_during_step is None:
            deadline = time.monotonic() + 5
            while (len(self.loop.batch["trained"]) < self.config.groups_per_step
                   and time.monotonic() < deadline):
                time.sleep(0.01)
            self.collected_during_step = len(self.loop.batch["trained"])
        return super().step(payload, groups)


def group(i: int, version: int):
    return make_group(4, 3, prompt_tokens=4, vocab_size=TINY_VOCAB_SIZE, policy_version=version,
                      seed=i, group_id=f"g{i}-v{version}")


async def trainer_beats(bus, run: str) -> list[Heartbeat]:
    async with bus.consumer([topic_name(run, "status")], group_id=unique_run()) as reader:
        beats = [decode(r.value, Heartbeat) for r in await reader.poll(timeout_s=0.5)]
    return [b for b in beats if b.role == "trainer"]


async def run_trainer(bus, run: str, model_dir, tmp_path, *, max_staleness: int,
                      max_steps: int, publish_after_v1=()) -> TrainerLoop:
    learner = Learner(model_dir, LearnerConfig(lr=1e-2), lora=LoraSettings(r=4, alpha=8))
    runner = WatchedRunner(learner, LoopConfig(run=run, out_dir=tmp_path, groups_per_step=2,
                                               max_staleness=max_staleness, max_steps=max_steps,
                                               checkpoint_every=0), base_model=str(model_dir))
    loop = runner.loop = TrainerLoop(bus, runner)
    trainer = asyncio.create_task(loop.run(asyncio.Event()))
    if publish_after_v1:  # groups a producer makes once version 1 is out
        while learner.policy_version < 1 and not trainer.done():
            await asyncio.sleep(0.01)
        for record in publish_after_v1:
            await bus.publish(topic_name(run, "trajectories"), encode(record))
    await asyncio.wait_for(trainer, 120)
    return loop


async def test_the_next_batch_is_collected_during_the_step_and_not_yet_consumed(model_dir,
                                                                                tmp_path):
    run = unique_run()
    async with open_bus("embedded://") as bus:
        await bus.create_topics(run_topics(run, trajectory_partitions=1))
        for i in range(4):
            await bus.publish(topic_name(run, "trajectories"), encode(group(i, 0)))
        loop = await run_trainer(bus, run, model_dir, tmp_path, max_staleness=1000,
                                 max_steps=2)
        beats = await trainer_beats(bus, run)
    assert loop.runner.collected_during_step == 2, "step 2's groups were read after step 1"
    assert [e["trained"] for e in ledger(tmp_path)] == [["g0-v0", "g1-v0"], ["g2-v0", "g3-v0"]]
    after_step_1 = [b.extra["consumed"] for b in beats if b.extra["step"] == 1]
    assert after_step_1 == [2], "step 2's batch, collected but not begun, counted as consumed"


async def test_groups_read_during_a_step_are_judged_against_the_version_it_makes(model_dir,
                                                                                 tmp_path):
    """On-policy: groups of version 0 read while step 1 makes version 1 would train at version
    1 (lag 1), so they are dropped; those of version 1 published after it are trained."""
    run = unique_run()
    async with open_bus("embedded://") as bus:
        await bus.create_topics(run_topics(run, trajectory_partitions=1))
        for i in range(4):
            await bus.publish(topic_name(run, "trajectories"), encode(group(i, 0)))
        loop = await run_trainer(bus, run, model_dir, tmp_path, max_staleness=0, max_steps=2,
                                 publish_after_v1=[group(4, 1), group(5, 1)])
    entries = ledger(tmp_path)
    assert [e["trained"] for e in entries] == [["g0-v0", "g1-v0"], ["g4-v1", "g5-v1"]]
    assert entries[1]["dropped"] == ["g2-v0", "g3-v0"]
    assert loop.lags == {0: 4}
    assert loop.counts["trainer/dropped_stale"] == 2
