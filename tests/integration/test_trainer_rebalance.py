"""Members joining and leaving the trainer's consumer group (both buses): every rebalance
revokes the trainer's partitions and hands them back; the trainer seeks to its own positions,
so no group is trained twice and none is skipped, although nothing was committed."""

from __future__ import annotations

import asyncio
import logging

import pytest

from miles.bus import open_bus
from miles.engines.base import LoraSettings
from miles.protocol.topics import run_topics, topic_name
from miles.trainer import distributed
from miles.trainer.learner import Learner, LearnerConfig
from miles.trainer.loop import LoopConfig, TrainerLoop
from miles.trainer.runner import StepRunner
from tests.accounting import assert_trained_once, ledger, publish_numbered
from tests.conftest import unique_run

PER_STEP, STEPS, ROUNDS = 4, 9, 3


@pytest.fixture(autouse=True)
def _process_group():
    yield
    distributed.destroy()


async def intrude(bus, run: str) -> bool:
    """Join the trainer's group, hold the partitions it hands over for a moment without
    reading on or committing, leave."""
    async with bus.consumer([topic_name(run, "trajectories")],
                            group_id=f"miles.{run}.trainer") as intruder:
        for _ in range(100):
            if intruder.assignment():
                break
            await intruder.poll(max_records=1, timeout_s=0.1)
        await asyncio.sleep(0.5)
        return bool(intruder.assignment())


async def test_members_joining_and_leaving_the_group_retrain_nothing(bus_url, model_dir,
                                                                    tmp_path, caplog):
    """Data arrives in rounds, a member joins and leaves between them: a trainer that took the
    group's offsets (none committed) would read every earlier round again."""
    caplog.set_level(logging.INFO, logger="miles.trainer.loop")
    run, per_round = unique_run(), PER_STEP * STEPS // ROUNDS
    async with open_bus(bus_url) as bus:
        await bus.create_topics(run_topics(run, trajectory_partitions=2))
        learner = Learner(model_dir, LearnerConfig(lr=1e-2), lora=LoraSettings(r=4, alpha=8))
        loop = TrainerLoop(bus, StepRunner(learner, LoopConfig(
            run=run, out_dir=tmp_path, groups_per_step=PER_STEP, max_steps=STEPS,
            max_staleness=1000, checkpoint_every=0), base_model=str(model_dir)))
        trainer = asyncio.create_task(loop.run(asyncio.Event()))
        published, joins = [], 0
        for round_ in range(ROUNDS):
            published += await publish_numbered(bus, run, len(published), per_round)
            while len(ledger(tmp_path)) < (round_ + 1) * STEPS // ROUNDS:
                assert not trainer.done(), trainer.result()
                await asyncio.sleep(0.02)
            if round_ < ROUNDS - 1:
                joins += await intrude(bus, run)
        await asyncio.wait_for(trainer, 300)
    assert joins >= 1
    assert_trained_once(ledger(tmp_path), published, steps=STEPS, per_step=PER_STEP)
    assert "partitions revoked" in caplog.text


async def test_a_rebalance_inside_a_poll_trains_its_records_once(bus_url, model_dir, tmp_path,
                                                                 monkeypatch):
    """The decoding consumer yields between records, so the group's callbacks can run while a
    poll holds records of the old assignment: the revocation seeks back to the trainer's
    position, and those records come again. Here the callbacks fire inside the first poll that
    returns records after two steps (what the group does on a rejoin after a pause, forced to
    that moment): before the fix, that poll's groups were trained twice."""
    from miles.bus.decoding import DecodingConsumer

    run, steps = unique_run(), 4
    real_poll, fired = DecodingConsumer.poll, []

    async def poll_with_rebalance(self, *args, **kwargs):
        items = await real_poll(self, *args, **kwargs)
        if items and not fired and self.name == "trainer" and loop.step >= 2:
            fired.append(len(items))
            assignment = set(self.consumer.assignment())
            await loop._on_revoked(assignment)
            await loop._on_assigned(assignment)
        return items

    monkeypatch.setattr(DecodingConsumer, "poll", poll_with_rebalance)
    async with open_bus(bus_url) as bus:
        await bus.create_topics(run_topics(run, trajectory_partitions=2))
        learner = Learner(model_dir, LearnerConfig(lr=1e-2), lora=LoraSettings(r=4, alpha=8))
        loop = TrainerLoop(bus, StepRunner(learner, LoopConfig(
            run=run, out_dir=tmp_path, groups_per_step=PER_STEP, max_steps=steps,
            max_staleness=1000, checkpoint_every=0), base_model=str(model_dir)))
        trainer = asyncio.create_task(loop.run(asyncio.Event()))
        published = await publish_numbered(bus, run, 0, PER_STEP * 2)
        while len(ledger(tmp_path)) < 2:
            assert not trainer.done(), trainer.result()
            await asyncio.sleep(0.02)
        published += await publish_numbered(bus, run, len(published), PER_STEP * (steps - 2))
        await asyncio.wait_for(trainer, 300)
    assert fired and fired[0] >= 1
    assert_trained_once(ledger(tmp_path), published, steps=steps, per_step=PER_STEP)
