"""Members joining and leaving the trainer's consumer group (both buses): every rebalance
revokes the trainer's partitions and hands them back; the trainer seeks to its own positions,
so no group is trained twice and none is skipped, although nothing was committed."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from miles.bus import open_bus
from miles.engines.base import LoraSettings
from miles.protocol import encode
from miles.protocol.topics import run_topics, topic_name
from miles.trainer import distributed
from miles.trainer.learner import Learner, LearnerConfig
from miles.trainer.loop import LoopConfig, StepRunner, TrainerLoop
from tests.conftest import unique_run
from tests.factories import make_group

PER_STEP, STEPS, ROUNDS = 4, 9, 3


@pytest.fixture(autouse=True)
def _process_group():
    yield
    distributed.destroy()


def ledger(out) -> list[dict]:
    path = out / "ledger.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def publish(bus, run: str, first: int, count: int) -> list[str]:
    ids = []
    for i in range(first, first + count):
        group = make_group(n_samples=4, n_tokens=3, prompt_tokens=4, vocab_size=70,
                           policy_version=0, seed=i, group_id=f"group-{i:03d}")
        await bus.publish(topic_name(run, "trajectories"), encode(group), partition=i % 2)
        ids.append(group.group_id)
    return ids


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
            published += await publish(bus, run, len(published), per_round)
            while len(ledger(tmp_path)) < (round_ + 1) * STEPS // ROUNDS:
                assert not trainer.done(), trainer.result()
                await asyncio.sleep(0.02)
            if round_ < ROUNDS - 1:
                joins += await intrude(bus, run)
        await asyncio.wait_for(trainer, 300)
    assert joins >= 1
    entries = ledger(tmp_path)
    assert [e["step"] for e in entries] == list(range(1, STEPS + 1))
    trained = [g for e in entries for g in e["trained"]]
    assert len(trained) == len(set(trained)) == PER_STEP * STEPS, "a group was trained twice"
    for parity in (0, 1):
        sent = [g for i, g in enumerate(published) if i % 2 == parity]
        got = [g for g in trained if int(g.split("-")[1]) % 2 == parity]
        assert sorted(got) == sent[:len(got)], "a group was skipped"
    assert "partitions revoked" in caplog.text
