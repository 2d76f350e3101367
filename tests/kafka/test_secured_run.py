"""A real RL run on the secured broker, each process with its own role's credentials.

`miles feed` (feeder) -> `producers.rollout` (producer) -> `consumers.trainer` (trainer), with
`consumers.recorder` and `miles status` as readers, each reading its identity from the
`MILES_KAFKA__*` variables and `MILES_KAFKA_PASSWORD`, as a deployment passes them. The roles
have exactly the ACLs of `miles.acls` (granted by `secured_run`), so this is the test that the
documented ACLs are enough for the real daemons; `test_secured_broker.py` checks that what a
role lacks is refused.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles.protocol import WeightVersion, decode
from miles.protocol.topics import topic_name
from miles.weights.signing import generate_key_pair
from tests.kafka.test_rl_processes import spawn, trainer_settings, wait_exit

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
STEPS = 2
PER_STEP = 2
FORGE = """
import asyncio, sys
from miles.bus import open_bus
from miles.errors import AuthorizationError

async def forge():
    async with open_bus(sys.argv[1]) as bus:  # the identity from MILES_KAFKA__*
        await bus.publish(sys.argv[2], b"a forged weight version")

try:
    asyncio.run(forge())
except AuthorizationError as err:
    print(err)
    sys.exit(3)
"""
EXIT_DENIED = 3


def miles_cli(args: list[str], env: dict[str, str], timeout_s: float = 60) -> str:
    result = subprocess.run([sys.executable, "-m", "miles.cli", *args], cwd=REPO,
                            env={**os.environ, **env}, capture_output=True, text=True,
                            timeout=timeout_s)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def start_recorder(url: str, run: str, out: Path, env: dict[str, str]) -> subprocess.Popen:
    args = [sys.executable, "-m", "consumers.recorder", "--set", f"bus={url}", "--set",
            f"run={run}", "--set", f"out_dir={out / 'archive'}", "--set", "file_seconds=1"]
    return subprocess.Popen(args, cwd=REPO, stdout=open(out / "recorder.log", "w"),
                            stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **env})


def wait_for_log(path: Path, pattern: str, process: subprocess.Popen,
                 timeout_s: float = 60) -> re.Match:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        found = re.search(pattern, path.read_text())
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"{path.name}: no {pattern!r}:\n{path.read_text()[-3000:]}")


def stop(process: subprocess.Popen, log: Path) -> dict:
    """SIGTERM, a clean exit, and the summary the daemon logs when it stops."""
    process.send_signal(signal.SIGTERM)
    wait_exit(process, log, 60)
    return json.loads(re.search(r"stopped: (\{.*\})", log.read_text()).group(1))


async def read_control(secured, run: str) -> list[int]:
    async with secured.bus("reader") as bus:
        async with bus.consumer([topic_name(run, "control")],
                                group_id=f"miles.{run}.audit") as consumer:
            records, deadline = [], time.monotonic() + 30
            while len(records) < STEPS + 1 and time.monotonic() < deadline:
                records += await consumer.poll(timeout_s=0.5)
            records += await consumer.poll(timeout_s=1.0)  # and nothing after them
    return [decode(r.value, WeightVersion).policy_version for r in records]


async def test_a_run_with_each_role_on_its_own_credentials(secured, secured_run, model_dir,
                                                           tmp_path):
    run, url = secured_run, secured.url
    feeder, producer_env, trainer_env, reader = (secured.env(role) for role in (
        "feeder", "producer", "trainer", "reader"))
    out = tmp_path / "out"
    out.mkdir()
    _, public_key = generate_key_pair(out / "keys")  # the trainer's default pair
    assert "published 40 prompts" in miles_cli(
        ["feed", "--bus", url, "--run", run, "--limit", "40"], feeder)
    logs = {name: tmp_path / f"{name}.log" for name in ("producer", "trainer")}
    producer = spawn("producers.rollout", [
        f"bus={url}", f"model_dir={model_dir}", "reward=tests.rewards:starts_with_digit",
        f"rollout.run={run}", f"rollout.prompts_per_batch={PER_STEP}",
        f"rollout.groups_per_step={PER_STEP}", "rollout.max_staleness=1",
        "rollout.sampling.n=2", "rollout.sampling.max_new_tokens=4", "rollout.heartbeat_s=0.5",
        f"rollout.weights.store={out / 'weights'}", f"rollout.weights.public_key={public_key}"],
        logs["producer"], env=producer_env)
    trainer = spawn("consumers.trainer", trainer_settings(
        url, run, model_dir, out, groups_per_step=PER_STEP, max_steps=STEPS, max_staleness=1,
        checkpoint_every=STEPS, heartbeat_s=0.5), logs["trainer"], env=trainer_env)
    recorder = start_recorder(url, run, tmp_path, reader)
    try:
        forged = subprocess.run([sys.executable, "-c", FORGE, url, topic_name(run, "control")],
                                cwd=REPO, env={**os.environ, **producer_env},
                                capture_output=True, text=True, timeout=60)
        assert forged.returncode == EXIT_DENIED, forged.stdout + forged.stderr[-3000:]
        assert f"user 'producer' access to topic {topic_name(run, 'control')}" in forged.stdout
        wait_exit(trainer, logs["trainer"], 120)
        wait_for_log(logs["producer"], r"loaded policy version [1-9]", producer)
        status = json.loads(miles_cli(["status", "--bus", url, "--run", run, "--json"], reader))
    except BaseException:
        for process in (producer, recorder, trainer):
            process.kill()
        raise
    produced = stop(producer, logs["producer"])
    recorded = stop(recorder, tmp_path / "recorder.log")
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert produced["producer/groups"] >= STEPS * PER_STEP, produced
    assert recorded["rows"] >= STEPS * PER_STEP * 2, recorded  # two samples a group
    assert await read_control(secured, run) == [0, 1, 2], "only the trainer's versions"
    assert status["producers"], status
    assert f"miles.{run}.trainer" in status["consumer_lag"], status["consumer_lag"]
