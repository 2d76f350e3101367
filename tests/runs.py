"""What the `miles run` tests share: a small dataset file, a config file, the command, and the
exactly-once check of a run's ledger against its trajectories topic."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from miles.bus import open_bus
from miles.protocol import DeadLetter, Heartbeat, TrajectoryGroup, WeightVersion, decode
from miles.protocol.topics import topic_name
from miles.tasks.datasets import load_problems
from tests.accounting import ledger


def write_dataset(path: Path, count: int) -> Path:
    """`count` arithmetic problems as JSONL (id, prompt, answer)."""
    rows = load_problems("arithmetic", "train")[:count]
    path.write_text("".join(json.dumps({"id": p.task_id, "prompt": p.prompt,
                                        "answer": p.answer}) + "\n" for p in rows))
    return path


def write_config(path: Path, model_dir: Path, out_dir: Path, dataset: Path, **settings) -> Path:
    """A small run's TOML: the session's tiny model, a small LoRA, 4 groups of 4 per step."""
    values = {"model_dir": str(model_dir), "out_dir": str(out_dir), "prompts": str(dataset),
              "eval_problems": 8, "eval_every_s": 5.0, "groups_per_step": 4,
              "export_policy": False, **settings}
    lines = [f"{key} = {json.dumps(value)}" for key, value in values.items()]
    lines += ["[lora]", "r = 4", "alpha = 8", "[sampling]", "n = 4", "max_new_tokens = 5"]
    path.write_text("\n".join(lines) + "\n")
    return path


def miles_command(*args: str) -> list[str]:
    return [sys.executable, "-c", "import sys; from miles.cli import main; sys.exit(main())",
            *args]


def start_run(config: Path, log: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(miles_command("run", str(config), *args), stdout=open(log, "a"),
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": os.getcwd()})


async def _read_topic(bus, topic: str) -> list:
    end = sum(end for _, end in (await bus.topic_offsets([topic])).values())
    records = []
    async with bus.consumer([topic], group_id=f"test-reader-{time.time_ns()}") as consumer:
        deadline = time.monotonic() + 60
        while len(records) < end and time.monotonic() < deadline:
            records.extend(await consumer.poll(timeout_s=1))
    return sorted(records, key=lambda r: (r.partition, r.offset))


async def published_groups(bus_url: str, run: str) -> tuple[list[str], dict[str, str]]:
    """The group ids on the run's trajectories topic (one partition), in offset order, and the
    reasons of those the trainer dead-lettered, by group id."""
    async with open_bus(bus_url) as bus:
        published = [decode(r.value, TrajectoryGroup).group_id
                     for r in await _read_topic(bus, topic_name(run, "trajectories"))]
        letters = [decode(r.value, DeadLetter) for r in await _read_topic(bus, topic_name(run, "dlq"))]
    trajectories = topic_name(run, "trajectories")
    lettered = {published[d.source_offset]: d.reason for d in letters
                if d.source_topic == trajectories and d.consumer == "trainer"}
    return published, lettered


async def ready_at(bus_url: str, run: str) -> float:
    """When the run's daemons could first train, from what they put on the bus: the later of the
    first producer's `started_at` (its heartbeats) and the first version's `created_at`."""
    async with open_bus(bus_url) as bus:
        beats = [decode(r.value) for r in await _read_topic(bus, topic_name(run, "status"))]
        control = [decode(r.value) for r in await _read_topic(bus, topic_name(run, "control"))]
    started = min(b.extra["started_at"] for b in beats
                  if isinstance(b, Heartbeat) and b.role == "producer")
    return max(started, min(v.created_at for v in control if isinstance(v, WeightVersion)))


def assert_judged_once(out_dir: Path, published: list[str],
                       lettered: dict[str, str]) -> list[dict]:
    """Every step once; no group in the ledger (trained, dropped, filtered, failed) twice; the
    ledger's groups and those the trainer's intake dead-lettered (a killed run's, perhaps read
    again after the resume) a prefix of the published ones: none skipped. Returns the ledger."""
    entries = ledger(out_dir)
    assert [e["step"] for e in entries] == list(range(1, len(entries) + 1))
    ledgered = [g for e in entries for kind in ("trained", "dropped", "filtered", "failed")
                for g in e[kind]]
    assert len(ledgered) == len(set(ledgered)), "a group was judged twice"
    judged = set(ledgered) | set(lettered)
    head = set(published[:len(judged)])
    assert judged == head, (
        "a group was skipped: judged but later on the topic "
        f"{[(published.index(g) if g in published else None, g) for g in judged - head]}"
        f", on the topic but not judged {[(published.index(g), g) for g in head - judged]}")
    return entries
