"""A group that makes a train step fail is isolated; the other groups of its step are trained.

The learner's step is all or nothing (a failing step changes no weight, no optimizer state, no
version, also with several mini-batches); `Isolation` bisects a failing batch down to the
groups that break it and trains the rest in one update; a bug is not mistaken for data. The
poison is planted in the model (`tests/poison.py`), where no validation of records can see it.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from miles.bus import open_bus
from miles.errors import StepError
from miles.protocol import DeadLetter, decode, encode
from miles.protocol.topics import run_topics, topic_name
from miles.rl.algorithm import AlgorithmConfig
from miles.trainer import distributed
from miles.trainer.isolation import MAX_FAILED_IN_A_ROW, Isolation
from miles.trainer.learner import Learner, LearnerConfig
from miles.trainer.loop import LoopConfig, TrainerLoop
from miles.trainer.model import LoraSettings
from miles.trainer.runner import StepRunner
from tests.accounting import assert_trained_once, ledger
from tests.conftest import unique_run
from tests.poison import good_groups, plant, poisoned

LORA = LoraSettings(r=4, alpha=8)
PER_STEP = 4


@pytest.fixture(scope="module", autouse=True)
def process_group():
    yield
    distributed.destroy()


def local(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach().clone()


def state(learner: Learner) -> list[torch.Tensor]:
    """Every trainable weight and every tensor of its optimizer state."""
    out = []
    for p in learner.params:
        out.append(local(p))
        out += [local(v) for v in learner.optimizer.state[p].values()]
    return out


def learner_for(model_dir, mode: str, mini_batches: int = 1) -> Learner:
    learner = Learner(model_dir, LearnerConfig(lr=1e-2, algorithm=AlgorithmConfig(
        mini_batches=mini_batches)), lora=LORA)
    plant(learner.model, mode)
    return learner


@pytest.mark.parametrize("mode", ["nan", "raise"])
def test_a_failing_step_of_two_mini_batches_changes_nothing(model_dir, mode):
    """The poison is in the second mini-batch: the first one already stepped when it fails."""
    learner = learner_for(model_dir, mode, mini_batches=2)
    learner.train_step(good_groups(4))  # the optimizer has state to protect
    before, version = state(learner), learner.policy_version
    with pytest.raises(StepError, match="non-finite" if mode == "nan" else "IndexError"):
        learner.train_step(good_groups(4, first=10) + [poisoned(good_groups(1, first=20)[0])])
    after = state(learner)
    assert learner.policy_version == version and learner.steps == 1
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))
    assert all(p.grad is None for p in learner.params)
    learner.train_step(good_groups(4, first=30))  # and the learner still trains
    assert learner.policy_version == version + 1


@pytest.mark.parametrize("mode", ["nan", "raise"])
@pytest.mark.parametrize("poison_at", [(3,), (0, 6)], ids=["one", "two"])
def test_the_failing_groups_are_isolated_and_the_rest_trained_in_one_update(
        model_dir, mode, poison_at):
    learner = learner_for(model_dir, mode)
    groups = good_groups(8)
    for i in poison_at:
        groups[i] = poisoned(groups[i])
    before = state(learner)
    calls = []
    train_step = learner.train_step
    learner.train_step = lambda gs, **kw: calls.append(kw) or train_step(gs, **kw)
    outcome = Isolation().train(learner, groups)
    assert sorted(outcome.failed) == list(poison_at)
    assert outcome.trained == [i for i in range(8) if i not in poison_at]
    reason = "step non-finite: grad_norm=nan" if mode == "nan" else "IndexError: id 77"
    assert all(r.startswith(reason) for r in outcome.failed.values()), outcome.failed
    assert learner.policy_version == 1, "one update for the trainer step"
    assert sum(not kw.get("apply", True) for kw in calls) <= 4 * len(poison_at) * 3
    assert not all(torch.equal(a, b) for a, b in zip(state(learner), before))
    assert outcome.metrics["trainer/tokens"] == (8 - len(poison_at)) * 4 * 5


def test_a_batching_error_is_isolated_too(model_dir):
    """A sampling setting the trainer cannot re-score is raised while batching (no forward)."""
    learner = Learner(model_dir, LearnerConfig(), lora=LORA)
    groups = good_groups(4)
    groups[2] = replace(groups[2], sampling={**groups[2].sampling, "temperature": 0.0})
    outcome = Isolation().train(learner, groups)
    assert list(outcome.failed) == [2] and "temperature=0.0" in outcome.failed[2]
    assert learner.policy_version == 1


def test_a_bug_is_not_isolated(model_dir):
    learner = learner_for(model_dir, "bug")
    groups = good_groups(4)
    groups[1] = poisoned(groups[1])
    with pytest.raises(TypeError, match="a bug"):
        Isolation().train(learner, groups)


def test_groups_failing_in_a_row_with_none_trained_stop_the_trainer(model_dir):
    """A model that fails on everything is not bad data: after MAX_FAILED_IN_A_ROW failing
    groups with none trained, the error propagates instead of dead-lettering the stream."""
    learner = learner_for(model_dir, "nan")
    isolation = Isolation()
    batches = [[poisoned(g) for g in good_groups(3, first=3 * k)] for k in range(4)]
    with pytest.raises(StepError, match="in a row"):
        for batch in batches:
            outcome = isolation.train(learner, batch)
            assert outcome.trained == [] and len(outcome.failed) == 3
    assert isolation.failed_in_a_row == 9 > MAX_FAILED_IN_A_ROW
    assert learner.policy_version == 0
    one_good = [poisoned(g) for g in good_groups(3)] + good_groups(1, first=50)
    assert Isolation().train(learner, one_good).trained == [3]  # one good group: data again


# -- the trainer loop -------------------------------------------------------------------------

async def publish(bus, run: str, count: int, poison: set[int] = frozenset()) -> list[str]:
    """Groups `group-000`.. on trajectory partition i % 2, those in `poison` poisoned."""
    ids = []
    for i, group in enumerate(good_groups(count)):
        group = poisoned(group) if i in poison else group
        await bus.publish(topic_name(run, "trajectories"), encode(group), partition=i % 2)
        ids.append(group.group_id)
    return ids


def trainer_loop(bus, model_dir, out: Path, run: str, *, steps: int, checkpoint_every: int,
                 mode: str | None = None) -> TrainerLoop:
    learner = Learner(model_dir, LearnerConfig(lr=1e-2), lora=LORA)
    if mode:
        plant(learner.model, mode)
    return TrainerLoop(bus, StepRunner(learner, LoopConfig(
        run=run, out_dir=out, groups_per_step=PER_STEP, max_steps=steps, max_staleness=1000,
        checkpoint_every=checkpoint_every), base_model=str(model_dir)))


async def dead_letters(bus, run: str, count: int) -> list[DeadLetter]:
    async with bus.consumer([topic_name(run, "dlq")], group_id="audit") as audit:
        letters, deadline = [], time.monotonic() + 30
        while len(letters) < count and time.monotonic() < deadline:
            letters += [decode(r.value, DeadLetter) for r in await audit.poll(timeout_s=0.5)]
    return letters


@pytest.mark.parametrize("mode", ["nan", "raise"])
async def test_the_trainer_dead_letters_a_group_that_fails_its_step_and_trains_the_rest(
        model_dir, tmp_path, mode):
    run, steps = unique_run(), 3
    async with open_bus("embedded://") as bus:
        await bus.create_topics(run_topics(run, trajectory_partitions=2))
        published = await publish(bus, run, PER_STEP * steps + 2, poison={5})
        loop = trainer_loop(bus, model_dir, tmp_path, run, steps=steps, checkpoint_every=2,
                            mode=mode)
        summary = await asyncio.wait_for(loop.run(asyncio.Event()), 300)
        letters = await dead_letters(bus, run, 1)
    entries = ledger(tmp_path)
    assert [e["step"] for e in entries] == [1, 2, 3]
    assert not any("group-005" in e["trained"] for e in entries), "the poison was 'trained'"
    assert sorted(e["failed"] for e in entries) == [[], [], ["group-005"]]
    poisoned_step = next(e for e in entries if e["failed"])
    assert len(poisoned_step["trained"]) == PER_STEP - 1, "the step's good groups trained"
    trained = [g for e in entries for g in e["trained"]]
    assert len(trained) == len(set(trained)) == PER_STEP * steps - 1
    handled = trained + ["group-005"]
    for parity in (0, 1):  # per partition, what was trained or dead-lettered is a prefix
        sent = published[parity::2]
        assert sorted(g for g in handled if int(g[-3:]) % 2 == parity) == \
            sent[:sum(int(g[-3:]) % 2 == parity for g in handled)]
    assert summary["policy_version"] == steps and summary["trainer/failed_groups"] == 1
    assert summary["trainer/dead_lettered"] == 1
    assert len(letters) == 1 and letters[0].source_offset == 2  # group-005: 3rd on partition 1
    assert letters[0].reason.startswith("train step failed: " + (
        "step non-finite" if mode == "nan" else "IndexError"))
    assert letters[0].payload == encode(poisoned(good_groups(6)[5]))
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["trainer/failed_groups"] == 1


async def test_a_step_that_crashes_leaves_no_ledger_line_and_its_groups_train_after_restart(
        model_dir, tmp_path):
    """The third step's update raises (not data: the trainer dies); its groups were never in
    an update, so the ledger must not list them, and a restarted trainer trains them."""
    run, steps = unique_run(), 5
    async with open_bus("embedded://") as bus:
        await bus.create_topics(run_topics(run, trajectory_partitions=2))
        published = await publish(bus, run, PER_STEP * steps + 2)
        first = trainer_loop(bus, model_dir, tmp_path, run, steps=steps, checkpoint_every=1)
        train_step, calls = first.learner.train_step, []

        def crashing(groups, **kw):
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("the machine fell over mid-step")
            return train_step(groups, **kw)

        first.learner.train_step = crashing
        with pytest.raises(RuntimeError, match="fell over"):
            await asyncio.wait_for(first.run(asyncio.Event()), 300)
        assert [e["step"] for e in ledger(tmp_path)] == [1, 2], "a line for the crashed step"
        second = trainer_loop(bus, model_dir, tmp_path, run, steps=steps, checkpoint_every=1)
        await asyncio.wait_for(second.run(asyncio.Event()), 300)
    assert_trained_once(ledger(tmp_path), published, steps=steps, per_step=PER_STEP)
