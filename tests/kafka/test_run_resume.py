"""`miles run` on Kafka: two producer processes and the trainer die with a `kill -9` of the run,
and `--resume` carries on with no group judged twice or skipped. Groups sampled by versions the
killed trainer announced after its last checkpoint are dead-lettered by the resumed trainer
("policy version 3 ... is above the trainer's 2"): judged with a reason, not trained."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import pytest

from tests.accounting import ledger
from tests.runs import (assert_judged_once, published_groups, ready_at, start_run, write_config,
                        write_dataset)

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def pids_alive(pids: list[int]) -> list[int]:
    import os

    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return alive


def children(pid: int) -> list[int]:
    from pathlib import Path

    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines()
                          if ":\t" in line)
        except OSError:
            continue
        if fields.get("PPid", "").strip() == str(pid):
            found.append(int(status.parent.name))
    return found


def test_a_killed_kafka_run_resumes_with_every_group_judged_once(kafka_broker, model_dir,
                                                                   tmp_path):
    dataset = write_dataset(tmp_path / "data.jsonl", 200)
    out = tmp_path / "out"
    config = write_config(tmp_path / "run.toml", model_dir, out, dataset, max_steps=7,
                          checkpoint_every=2, max_staleness=2, producers=2,
                          bus=kafka_broker.url, run=f"resume-{int(time.time())}")
    log = tmp_path / "run.log"
    first = start_run(config, log)
    deadline = time.monotonic() + 240
    while len(ledger(out)) < 3 and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    daemons = children(first.pid)
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert len(daemons) == 3, log.read_text()[-3000:]  # the trainer and two producers
    deadline = time.monotonic() + 10
    while pids_alive(daemons) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pids_alive(daemons), "the daemons outlived the killed run"
    assert 3 <= len(ledger(out)) < 7, log.read_text()[-3000:]
    resumed = start_run(config, log, "--resume")
    assert resumed.wait(300) == 0, log.read_text()[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert (report["ended_by"], report["steps"]) == ("max_steps", 7)
    assert "resumed at step" in (out / "trainer.log").read_text()
    run = json.loads((out / "run.json").read_text())["run"]
    published, lettered = asyncio.run(published_groups(kafka_broker.url, run))
    assert len(assert_judged_once(out, published, lettered)) == 7
    # the resumed run ran both producers to a clean stop. Which of them published is arrival
    # order: one that joins the prompts group late may find the other's 16 groups already made
    # (the group rebalances only on the first one's next heartbeat), as it did twice in CI
    for producer in ("producer-0", "producer-1"):
        assert "producers.rollout: stopped:" in (out / f"{producer}.log").read_text(), producer


def test_a_kafka_run_trains_on_two_ranks_under_torchrun(kafka_broker, model_dir, tmp_path):
    dataset = write_dataset(tmp_path / "data.jsonl", 64)
    out = tmp_path / "out"
    config = write_config(tmp_path / "run.toml", model_dir, out, dataset, max_steps=2,
                          trainer_ranks=2, bus=kafka_broker.url)
    log = tmp_path / "run.log"
    assert start_run(config, log).wait(300) == 0, log.read_text()[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert (report["ended_by"], report["steps"]) == ("max_steps", 2)
    assert "host RAM / 2 local rank(s)" in (out / "trainer.log").read_text()
    # the RL clock starts when the daemons could train, as they said on the bus, not when the
    # run's process read it (that came later, with versions trained before t=0)
    run = json.loads((out / "run.json").read_text())["run"]
    ready = asyncio.run(ready_at(kafka_broker.url, run))
    assert report["rl_started_at"] == pytest.approx(ready, abs=1e-6)
