"""Soak: a real run under random faults, with the delivery accounting at the end.

A local broker, a trainer and two producers (the tiny model, the arithmetic task) run for
`--minutes`; every `--every` seconds (jittered) one fault strikes: `kill -9` or a SIGSTOP past
the session timeout of the trainer or of a producer (restarted or resumed), or a broker restart.
At the end the producers and the trainer are stopped gracefully and the log is audited:

- trained twice: group ids appearing more than once among the ledger's trained groups;
- lost: groups on the trajectories topic below the trainer's final positions that the ledger
  neither trained, dropped nor filtered (dead-lettered ones are counted apart);
- steps: the ledger's steps must be 1..N;
- recovery: seconds from each trainer fault to its next ledger step.

    python benchmarks/soak_faults.py --minutes 30 --every 120 --out runs/soak

Writes `<out>/soak.json` and prints it. Not a test: it takes as long as you ask.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from miles import broker
from miles.bus import open_bus
from miles.errors import CodecError
from miles.feeder import feed
from miles.protocol import TrajectoryGroup, decode
from miles.protocol.topics import run_topics, topic_name
from miles.tasks.arithmetic import arithmetic_problems
from miles.tasks.tiny_model import build_tiny_model
from miles.trainer.checkpoint import newest_meta

REPO = Path(__file__).resolve().parents[1]
PAUSE_S = 15  # past aiokafka's 10 s session timeout
FAULTS = ("kill-trainer", "pause-trainer", "kill-producer", "pause-producer", "restart-broker")


class Fleet:
    """The run's processes, started and restarted with the same settings."""

    def __init__(self, url: str, run: str, model_dir: Path, out: Path):
        self.url, self.run, self.model_dir, self.out = url, run, model_dir, out
        self.procs: dict[str, subprocess.Popen] = {}
        self.starts: dict[str, int] = {}

    def _settings(self, name: str) -> tuple[str, list[str]]:
        common = [f"bus={self.url}", f"model_dir={self.model_dir}", "lora.r=4", "lora.alpha=8",
                  "torch_threads=1"]
        if name == "trainer":
            return "consumers.trainer", common + [
                "learner.lr=0.01", f"loop.run={self.run}", f"loop.out_dir={self.out / 'trainer'}",
                "loop.groups_per_step=8", "loop.max_staleness=4", "loop.checkpoint_every=5"]
        return "producers.rollout", common + [
            "reward=math", f"rollout.run={self.run}", f"rollout.producer_id={name}",
            "rollout.prompts_per_batch=8", "rollout.groups_per_step=8",
            "rollout.max_staleness=4", "rollout.sampling.n=4",
            "rollout.sampling.max_new_tokens=6", "rollout.heartbeat_s=1",
            f"rollout.weights.store={self.out / 'trainer' / 'weights'}"]

    def start(self, name: str) -> None:
        module, settings = self._settings(name)
        args = [sys.executable, "-m", module]
        for item in settings:
            args += ["--set", item]
        self.starts[name] = self.starts.get(name, 0) + 1
        log = open(self.out / f"{name}.{self.starts[name]}.log", "w")
        self.procs[name] = subprocess.Popen(args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                            env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def signal(self, name: str, sig: int) -> None:
        self.procs[name].send_signal(sig)

    def stop_all(self, timeout_s: float = 120) -> dict[str, int]:
        codes = {}
        for name in sorted(self.procs, key=lambda n: n == "trainer"):  # producers first
            proc = self.procs[name]
            proc.send_signal(signal.SIGCONT)
            proc.send_signal(signal.SIGTERM)
            try:
                codes[name] = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[name] = proc.wait()
        return codes


def ledger(out: Path) -> list[dict]:
    path = out / "trainer" / "ledger.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def strike(fault: str, fleet: Fleet, data_dir: Path, port: int) -> None:
    producer = random.choice(["producer-a", "producer-b"])
    if fault == "kill-trainer":
        fleet.signal("trainer", signal.SIGKILL)
        fleet.procs["trainer"].wait()
        fleet.start("trainer")
    elif fault == "pause-trainer":
        fleet.signal("trainer", signal.SIGSTOP)
        await asyncio.sleep(PAUSE_S)
        fleet.signal("trainer", signal.SIGCONT)
    elif fault == "kill-producer":
        fleet.signal(producer, signal.SIGKILL)
        fleet.procs[producer].wait()
        fleet.start(producer)
    elif fault == "pause-producer":
        fleet.signal(producer, signal.SIGSTOP)
        await asyncio.sleep(PAUSE_S)
        fleet.signal(producer, signal.SIGCONT)
    elif fault == "restart-broker":
        await asyncio.to_thread(broker.stop_broker, data_dir=data_dir)
        await asyncio.sleep(5)
        await asyncio.to_thread(broker.start_broker, data_dir=data_dir, port=port, heap="512m")


async def audit(url: str, run: str, out: Path) -> dict:
    entries = ledger(out)
    trained = [g for e in entries for g in e["trained"]]
    judged = set(trained) | {g for e in entries for k in ("dropped", "filtered") for g in e[k]}
    meta = newest_meta(out / "trainer" / "checkpoints") or {"offsets": {}}
    below: list[str] = []
    invalid = 0
    async with open_bus(url) as bus:
        ends = await bus.topic_offsets([topic_name(run, "trajectories")])
        async with bus.consumer([topic_name(run, "trajectories")], group_id="soak-audit") as c:
            read = 0
            total = sum(end for _, end in ends.values())
            deadline = time.monotonic() + 120
            while read < total and time.monotonic() < deadline:
                for record in await c.poll(timeout_s=1.0):
                    read += 1
                    final = int(meta["offsets"].get(f"{record.topic}:{record.partition}", 0))
                    if record.offset >= final:
                        continue
                    try:
                        below.append(decode(record.value, TrajectoryGroup).group_id)
                    except CodecError:  # dead-lettered by the trainer; counted here
                        invalid += 1
    return {"steps": len(entries),
            "steps_in_order": [e["step"] for e in entries] == list(range(1, len(entries) + 1)),
            "groups_trained": len(trained), "trained_twice": len(trained) - len(set(trained)),
            "lost": len([g for g in below if g not in judged]), "invalid_below_end": invalid,
            "groups_published": total}


def recovery_times(out: Path, faults: list[tuple[float, str]]) -> list[float]:
    times = sorted(e.get("time", 0.0) for e in metrics_lines(out))
    result = []
    for at, fault in faults:
        if fault.endswith("trainer") or fault == "restart-broker":
            after = [t for t in times if t > at]
            if after:
                result.append(round(after[0] - at, 1))
    return result


def metrics_lines(out: Path) -> list[dict]:
    path = out / "trainer" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def soak(args) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data_dir, port = out / "broker", broker.free_port()
    local = await asyncio.to_thread(broker.start_broker, data_dir=data_dir, port=port,
                                    heap="512m")
    url, run = f"kafka://{local.bootstrap}", f"soak{int(time.time())}"
    model_dir = build_tiny_model(out / "model", hidden_size=64, layers=2)
    async with open_bus(url) as bus:
        await bus.create_topics(run_topics(run, prompt_partitions=4, trajectory_partitions=2))
        await feed(bus, run, arithmetic_problems("train"), epochs=args.epochs)
    fleet = Fleet(url, run, model_dir, out)
    for name in ("trainer", "producer-a", "producer-b"):
        fleet.start(name)
    faults: list[tuple[float, str]] = []
    began = time.monotonic()
    try:
        while time.monotonic() - began < args.minutes * 60:
            await asyncio.sleep(args.every * random.uniform(0.5, 1.5))
            fault = random.choice(FAULTS)
            print(f"{time.monotonic() - began:7.0f} s  {fault}", flush=True)
            faults.append((time.time(), fault))
            await strike(fault, fleet, data_dir, port)
        codes = fleet.stop_all()
        result = await audit(url, run, out)
    finally:
        for proc in fleet.procs.values():
            if proc.poll() is None:
                proc.kill()
        await asyncio.to_thread(broker.stop_broker, data_dir=data_dir)
    result.update({"minutes": args.minutes, "faults": [f for _, f in faults],
                   "exit_codes": codes, "recovery_s": recovery_times(out, faults),
                   "starts": fleet.starts})
    (out / "soak.json").write_text(json.dumps(result, indent=2))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--every", type=float, default=120.0, help="mean seconds between faults")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/soak")
    args = parser.parse_args()
    random.seed(args.seed)
    print(json.dumps(asyncio.run(soak(args)), indent=2))


if __name__ == "__main__":
    main()
