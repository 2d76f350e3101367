"""Trainer faults on the real broker, each asserted from the ledger, the metrics and the
trajectories topic: steps 1..N once each, no group trained twice, none skipped (per partition the
trained groups are a prefix of what was published), counters that never restart.

- a trainer paused (SIGSTOP) longer than its consumer session: the group evicts it, it rejoins;
- a trainer killed before its first checkpoint, or whose newest checkpoint is damaged, restarts;
- `kill -9` of the torchrun agent orphans its worker; the trainer started next fences it;
- a trainer killed while a step's update runs has no ledger line for that step.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import pytest

from miles.bus import open_bus
from miles.protocol import WeightVersion, decode
from miles.protocol.topics import run_topics, topic_name
from miles.trainer.checkpoint import checkpoint_step
from tests.accounting import assert_trained_once, ledger, publish_numbered
from tests.conftest import unique_run
from tests.kafka.test_rl_processes import spawn, trainer_settings, wait_exit

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
PER_STEP = 4
SESSION_PAUSE_S = 14  # > aiokafka's default session timeout (10 s): the group evicts the member
TORCHRUN_1 = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
EXIT_FENCED = 3


async def publish_groups(url: str, run: str, first: int, count: int,
                         *, create: bool = True) -> list[str]:
    async with open_bus(url) as bus:
        if create:
            await bus.create_topics(run_topics(run, trajectory_partitions=2))
        return await publish_numbered(bus, run, first, count)


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_exactly_once(out: Path, published: list[str], steps: int) -> None:
    assert_trained_once(ledger(out), published, steps=steps, per_step=PER_STEP)
    lines = metrics(out)
    assert [m["step"] for m in lines] == list(range(1, steps + 1))
    assert [m["trainer/groups_trained"] for m in lines] == \
        [PER_STEP * k for k in range(1, steps + 1)], "counters restarted"


async def wait_for_steps(out: Path, count: int, process, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while len(ledger(out)) < count:
        assert time.monotonic() < deadline and process.poll() is None, "trainer made no progress"
        await asyncio.sleep(0.02)


async def test_a_trainer_paused_past_its_session_timeout_trains_nothing_twice(
        kafka_broker, model_dir, tmp_path):
    """The trainer has read everything published and waits; it is paused until the group evicts
    it, then more groups arrive. No checkpoint before the end (nothing committed): a rejoin that
    took the group's offsets would read the first groups again."""
    run, steps, before = unique_run(), 10, 4
    published = await publish_groups(kafka_broker.url, run, 0, PER_STEP * before)
    out = tmp_path / "out"
    trainer = spawn("consumers.trainer", trainer_settings(
        kafka_broker.url, run, model_dir, out, groups_per_step=PER_STEP, max_steps=steps,
        max_staleness=1000, checkpoint_every=0), tmp_path / "trainer.log")
    await wait_for_steps(out, before, trainer)
    trainer.send_signal(signal.SIGSTOP)
    await asyncio.sleep(SESSION_PAUSE_S)
    trainer.send_signal(signal.SIGCONT)
    published += await publish_groups(kafka_broker.url, run, len(published),
                                      PER_STEP * (steps - before) + 4, create=False)
    wait_exit(trainer, tmp_path / "trainer.log", 240)
    assert_exactly_once(out, published, steps)
    assert "partitions revoked" in (tmp_path / "trainer.log").read_text(), "no rebalance"


@pytest.mark.parametrize("checkpoint_every, damage", [(1, None), (1000, None), (1, "meta.json"),
                                                      (1, "latest")],
                         ids=["killed-mid-run", "no-checkpoint-yet", "newest-meta-missing",
                              "latest-dangling"])
async def test_a_restarted_trainer_resumes_exactly_once(kafka_broker, model_dir, tmp_path,
                                                        checkpoint_every, damage):
    run, steps = unique_run(), 8
    published = await publish_groups(kafka_broker.url, run, 0, PER_STEP * steps + 6)
    out = tmp_path / "out"
    settings = trainer_settings(kafka_broker.url, run, model_dir, out,
                                groups_per_step=PER_STEP, max_steps=steps, max_staleness=1000,
                                checkpoint_every=checkpoint_every)
    first = spawn("consumers.trainer", settings, tmp_path / "first.log")
    await wait_for_steps(out, 4, first)
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=30)
    assert len(ledger(out)) < steps
    checkpoints = sorted((p for p in (out / "checkpoints").glob("step_*")
                          if checkpoint_step(p) is not None), key=checkpoint_step)
    if damage == "meta.json":
        (checkpoints[-1] / "meta.json").unlink()
    elif damage == "latest":
        (out / "checkpoints" / "latest").write_text("step_99999999")

    second = spawn("consumers.trainer", settings, tmp_path / "second.log")
    wait_exit(second, tmp_path / "second.log", 240)
    assert_exactly_once(out, published, steps)
    log_text = (tmp_path / "second.log").read_text()
    if damage == "meta.json":
        assert f"skipping checkpoint {checkpoints[-1]}" in log_text
        assert f"resumed at step {checkpoint_step(checkpoints[-2])}" in log_text
    elif damage == "latest" or checkpoint_every == 1:
        assert f"resumed at step {checkpoint_step(checkpoints[-1])}" in log_text
    else:
        assert "started at step 0" in log_text


@pytest.mark.parametrize("checkpoint_every", [1, 1000], ids=["checkpointed", "no-checkpoint"])
async def test_a_trainer_killed_mid_step_has_no_ledger_line_for_it(kafka_broker, model_dir,
                                                                   tmp_path, monkeypatch,
                                                                   checkpoint_every):
    """SIGKILL while step 3's update runs (steps slowed by `slow_trainer`): the ledger lists
    steps 1 and 2 only (the groups of step 3 were never in an update), and the restarted
    trainer trains every group exactly once."""
    run, steps, killed_in = unique_run(), 5, 3
    published = await publish_groups(kafka_broker.url, run, 0, PER_STEP * steps + 6)
    out = tmp_path / "out"
    marker = tmp_path / "step_running"
    monkeypatch.setenv("MILES_TEST_STEP_MARKER", str(marker))
    monkeypatch.setenv("MILES_TEST_STEP_SLEEP_S", "2")
    settings = trainer_settings(kafka_broker.url, run, model_dir, out,
                                groups_per_step=PER_STEP, max_steps=steps, max_staleness=1000,
                                checkpoint_every=checkpoint_every)
    first = spawn("tests.kafka.slow_trainer", settings, tmp_path / "first.log")
    deadline = time.monotonic() + 180
    while not (marker.exists() and marker.read_text() == str(killed_in)):
        assert time.monotonic() < deadline and first.poll() is None, \
            (tmp_path / "first.log").read_text()[-3000:]
        await asyncio.sleep(0.02)
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=30)
    assert [e["step"] for e in ledger(out)] == [1, 2], "a ledger line for the killed step"
    assert [m["step"] for m in metrics(out)] == [1, 2]

    second = spawn("consumers.trainer", settings, tmp_path / "second.log")
    wait_exit(second, tmp_path / "second.log", 240)
    assert_exactly_once(out, published, steps)


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


async def test_an_orphaned_worker_is_fenced_by_the_trainer_that_replaces_it(
        kafka_broker, model_dir, tmp_path):
    run, steps, first_steps = unique_run(), 12, 6
    published = await publish_groups(kafka_broker.url, run, 0, PER_STEP * first_steps)
    out = tmp_path / "out"
    settings = trainer_settings(kafka_broker.url, run, model_dir, out,
                                groups_per_step=PER_STEP, max_steps=steps, max_staleness=1000,
                                checkpoint_every=1)
    agent = spawn("consumers.trainer", settings, tmp_path / "first.log", launcher=TORCHRUN_1)
    workers = []
    try:
        await wait_for_steps(out, first_steps, agent)
        workers = children(agent.pid)
        agent.send_signal(signal.SIGKILL)
        agent.wait(timeout=30)
        await asyncio.sleep(1.0)
        assert workers and all(alive(w) for w in workers), "the worker did not outlive its agent"

        second = spawn("consumers.trainer", settings, tmp_path / "second.log")
        deadline = time.monotonic() + 120
        while any(alive(w) for w in workers):
            assert time.monotonic() < deadline, "the orphan was not fenced"
            await asyncio.sleep(0.2)
        published += await publish_groups(kafka_broker.url, run, len(published),
                                          PER_STEP * (steps - first_steps) + 4, create=False)
        wait_exit(second, tmp_path / "second.log", 240)
    finally:
        for pid in workers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    first_log = (tmp_path / "first.log").read_text()
    assert "fenced: trainer generation 2 took over" in first_log, first_log[-3000:]
    assert_exactly_once(out, published, steps)
    async with open_bus(kafka_broker.url) as bus:
        async with bus.consumer([topic_name(run, "control")], group_id="audit") as audit:
            records, deadline = [], time.monotonic() + 20
            while len(records) < steps + 2 and time.monotonic() < deadline:
                records += await audit.poll(timeout_s=0.5)
    generations = [decode(r.value, WeightVersion).trainer_generation for r in records]
    assert generations == sorted(generations) and generations[-1] == 2, generations
