"""Groups the trainer rejects (embedded bus): dead-lettered once, counted, their offsets consumed,
so a rejected group never holds the trainer's position and a trainer resumed from a later
checkpoint never reads it again."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import pytest

from miles.bus import open_bus
from miles.engines.base import LoraSettings
from miles.protocol import DeadLetter, decode, encode
from miles.protocol.topics import run_topics, topic_name
from miles.trainer import distributed
from miles.trainer.learner import Learner, LearnerConfig
from miles.trainer.loop import LoopConfig, TrainerLoop
from miles.trainer.runner import StepRunner
from tests.accounting import TINY_VOCAB_SIZE, ledger
from tests.conftest import unique_run
from tests.factories import make_group, make_sample


@pytest.fixture(autouse=True)
def _process_group():
    yield
    distributed.destroy()


def good(i: int):
    return make_group(4, 3, prompt_tokens=4, vocab_size=TINY_VOCAB_SIZE, policy_version=0,
                      seed=i, group_id=f"good-{i}")


def bad(i: int, kind: str):
    if kind == "temperature":
        return make_group(4, 3, prompt_tokens=4, vocab_size=TINY_VOCAB_SIZE, seed=i,
                          policy_version=0, group_id=f"bad-{i}", sampling={"temperature": 0.0})
    versions = np.full(3, 1000, dtype=np.int32)
    return make_group(prompt_tokens=4, vocab_size=TINY_VOCAB_SIZE, group_id=f"bad-{i}",
                      samples=[make_sample(3, vocab_size=TINY_VOCAB_SIZE, versions=versions)])


async def dead_letters(bus, run: str) -> list[DeadLetter]:
    async with bus.consumer([topic_name(run, "dlq")], group_id=unique_run()) as audit:
        return [decode(r.value, DeadLetter) for r in await audit.poll(timeout_s=0.5)]


async def test_rejected_groups_are_consumed_and_never_read_again(model_dir, tmp_path):
    run = unique_run()
    learner = Learner(model_dir, LearnerConfig(lr=1e-2), lora=LoraSettings(r=4, alpha=8))
    config = LoopConfig(run=run, out_dir=tmp_path, groups_per_step=2, max_staleness=1000,
                        checkpoint_every=1)
    async with open_bus("embedded://") as bus:
        await bus.create_topics(run_topics(run, trajectory_partitions=1))
        trajectories = topic_name(run, "trajectories")
        for record in (good(0), bad(1, "temperature"), good(2), bad(3, "versions"),
                       bad(4, "temperature")):  # offsets 0..4, the last two after the step's
            await bus.publish(trajectories, encode(record))
        first = TrainerLoop(bus, StepRunner(learner, replace(config, max_steps=1),
                                            base_model=str(model_dir)))
        summary = await asyncio.wait_for(first.run(asyncio.Event()), 120)
        assert summary["trainer/rejected_groups"] == 3
        assert summary["trainer/rejected/sampling"] == 2
        assert summary["trainer/rejected/versions"] == 1
        assert set(first.positions.values()) == {5}, "a rejected group holds the position"

        for record in (bad(5, "versions"), good(6), good(7)):
            await bus.publish(trajectories, encode(record))
        second = TrainerLoop(bus, StepRunner(learner, replace(config, max_steps=2),
                                             base_model=str(model_dir)))
        summary = await asyncio.wait_for(second.run(asyncio.Event()), 120)
        letters = await dead_letters(bus, run)
    assert [e["trained"] for e in ledger(tmp_path)] == [["good-0", "good-2"], ["good-6", "good-7"]]
    assert [letter.source_offset for letter in letters] == [1, 3, 4, 5], "read again on resume"
    assert [letter.reason.split(":")[0] for letter in letters] == [
        "sampling.temperature", "samples[0].versions", "sampling.temperature",
        "samples[0].versions"]
    assert summary["trainer/rejected_groups"] == 4  # restored from the checkpoint, then one more
    assert summary["trainer/dead_lettered"] == 4
    assert set(second.positions.values()) == {8}
