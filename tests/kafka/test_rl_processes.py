"""Producer and trainer as separate processes on the real broker: versions advance, the
producer hot-loads them (trainer on two ranks under torchrun), and a trainer killed with
SIGKILL resumes exactly once."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles.bus import open_bus
from miles.feeder import feed
from miles.protocol import WeightVersion, decode, encode
from miles.protocol.topics import run_topics, topic_name
from miles.tasks.arithmetic import arithmetic_problems
from tests.conftest import unique_run
from tests.factories import make_group

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
COMMON = ["lora.r=4", "lora.alpha=8", "torch_threads=1"]


TORCHRUN_2 = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def spawn(module: str, settings: list[str], log: Path, launcher: tuple = ()) -> subprocess.Popen:
    args = [sys.executable, *launcher, "-m", module]
    for item in COMMON + settings:
        args += ["--set", item]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(args, cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env=env)


def trainer_settings(bus: str, run: str, model_dir: Path, out: Path, **loop) -> list[str]:
    return [f"bus={bus}", f"model_dir={model_dir}", "learner.lr=0.01", f"loop.run={run}",
            f"loop.out_dir={out}"] + [f"loop.{k}={v}" for k, v in loop.items()]


def ledger(out: Path) -> list[dict]:
    path = out / "ledger.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def wait_exit(process: subprocess.Popen, log: Path, timeout_s: float) -> None:
    try:
        assert process.wait(timeout=timeout_s) == 0, log.read_text()[-3000:]
    except subprocess.TimeoutExpired:
        process.kill()
        raise AssertionError(f"{log.name} did not finish:\n{log.read_text()[-3000:]}") from None


async def test_producer_and_two_rank_trainer_processes(kafka_broker, model_dir, tmp_path):
    run = unique_run()
    async with open_bus(kafka_broker.url) as bus:
        await bus.create_topics(run_topics(run, prompt_partitions=2, trajectory_partitions=2))
        await feed(bus, run, arithmetic_problems("train")[:300])
    producer = spawn("producers.rollout", [
        f"bus={kafka_broker.url}", f"model_dir={model_dir}", "reward=tests.rewards:starts_with_digit",
        f"rollout.run={run}", "rollout.prompts_per_batch=4", "rollout.groups_per_step=4",
        "rollout.max_staleness=1", "rollout.sampling.n=4", "rollout.sampling.max_new_tokens=4",
        "rollout.heartbeat_s=0.5"], tmp_path / "producer.log")
    trainer = spawn("consumers.trainer", trainer_settings(
        kafka_broker.url, run, model_dir, tmp_path / "out", groups_per_step=4, max_steps=4,
        max_staleness=1, checkpoint_every=2), tmp_path / "trainer.log", launcher=TORCHRUN_2)
    try:
        wait_exit(trainer, tmp_path / "trainer.log", 240)
    finally:
        producer.send_signal(signal.SIGTERM)
        producer_rc = producer.wait(timeout=60)
    producer_log = (tmp_path / "producer.log").read_text()
    assert producer_rc == 0, producer_log[-3000:]
    assert "loaded policy version 3" in producer_log or "loaded policy version 4" in producer_log
    async with open_bus(kafka_broker.url) as bus:
        async with bus.consumer([topic_name(run, "control")], group_id="audit") as audit:
            records = []
            deadline = time.monotonic() + 30
            while len(records) < 5 and time.monotonic() < deadline:
                records += await audit.poll(timeout_s=0.5)
    assert [decode(r.value, WeightVersion).policy_version for r in records] == [0, 1, 2, 3, 4]
    entries = ledger(tmp_path / "out")
    assert [e["step"] for e in entries] == [1, 2, 3, 4]
    metrics = [json.loads(line) for line in
               (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert all(m["trainer/max_lag"] <= 1 for m in metrics)


async def test_trainer_killed_mid_run_resumes_exactly_once(kafka_broker, model_dir, tmp_path):
    run, per_step, steps = unique_run(), 4, 8
    published: list[str] = []
    async with open_bus(kafka_broker.url) as bus:
        await bus.create_topics(run_topics(run, trajectory_partitions=2))
        for i in range(per_step * steps + 6):
            group = make_group(n_samples=4, n_tokens=3, prompt_tokens=4, vocab_size=70,
                               policy_version=0, seed=i, group_id=f"group-{i:03d}")
            await bus.publish(topic_name(run, "trajectories"), encode(group), partition=i % 2)
            published.append(group.group_id)
    out = tmp_path / "out"
    settings = trainer_settings(kafka_broker.url, run, model_dir, out, groups_per_step=per_step,
                                max_steps=steps, max_staleness=1000, checkpoint_every=1)
    first = spawn("consumers.trainer", settings, tmp_path / "first.log")
    deadline = time.monotonic() + 180
    while len(ledger(out)) < 3 and time.monotonic() < deadline and first.poll() is None:
        await asyncio.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=30)
    before_kill = ledger(out)
    assert 3 <= len(before_kill) < steps, (tmp_path / "first.log").read_text()[-3000:]

    second = spawn("consumers.trainer", settings, tmp_path / "second.log")
    wait_exit(second, tmp_path / "second.log", 240)
    assert "resumed at step" in (tmp_path / "second.log").read_text()

    entries = ledger(out)
    assert [e["step"] for e in entries] == list(range(1, steps + 1))
    trained = [g for e in entries for g in e["trained"]]
    assert len(trained) == len(set(trained)) == per_step * steps, "a group was trained twice"
    assert not any(e["dropped"] for e in entries)
    # Nothing skipped: per partition, the trained groups are a prefix of what was published.
    for parity in (0, 1):
        sent = [g for i, g in enumerate(published) if i % 2 == parity]
        got = [g for g in trained if int(g.split("-")[1]) % 2 == parity]
        assert sorted(got) == sent[:len(got)]
