"""Producer and trainer as separate processes on the real broker: versions advance and the
producer hot-loads them (trainer on two ranks under torchrun). The process helpers here serve
the other process tests (`test_trainer_faults.py`, `test_elastic.py`)."""

from __future__ import annotations

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
from miles.protocol import WeightVersion, decode
from miles.protocol.topics import run_topics, topic_name
from miles.tasks.arithmetic import arithmetic_problems
from miles.weights.signing import generate_key_pair
from tests.conftest import unique_run
from tests.accounting import ledger

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
COMMON = ["lora.r=4", "lora.alpha=8", "torch_threads=1"]


TORCHRUN_2 = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def spawn(module: str, settings: list[str], log: Path, launcher: tuple = (),
          env: dict[str, str] | None = None) -> subprocess.Popen:
    """`python -m module --set ...` logging to `log`, with `env` added to this environment."""
    args = [sys.executable, *launcher, "-m", module]
    for item in COMMON + settings:
        args += ["--set", item]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.Popen(args, cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env=env)


def trainer_settings(bus: str, run: str, model_dir: Path, out: Path, **loop) -> list[str]:
    return [f"bus={bus}", f"model_dir={model_dir}", "learner.lr=0.01", f"loop.run={run}",
            f"loop.out_dir={out}"] + [f"loop.{k}={v}" for k, v in loop.items()]


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
    _, public_key = generate_key_pair(tmp_path / "out" / "keys")  # the trainer's default pair
    producer = spawn("producers.rollout", [
        f"bus={kafka_broker.url}", f"model_dir={model_dir}", "reward=tests.rewards:starts_with_digit",
        f"rollout.run={run}", "rollout.prompts_per_batch=4", "rollout.groups_per_step=4",
        "rollout.max_staleness=1", "rollout.sampling.n=4", "rollout.sampling.max_new_tokens=4",
        "rollout.heartbeat_s=0.5", f"rollout.weights.store={tmp_path / 'out' / 'weights'}",
        f"rollout.weights.public_key={public_key}"], tmp_path / "producer.log")
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
    assert "ignoring" not in producer_log and "NO PUBLIC KEY" not in producer_log
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
