"""What the `miles run` tests share: a small dataset file, a config file, the command, and the
exactly-once check of a run's ledger against its trajectories topic."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from miles.bus import open_bus
from miles.protocol import TrajectoryGroup, decode
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


async def published_groups(bus_url: str, run: str) -> list[str]:
    """The group ids on the run's trajectories topic (one partition), in offset order."""
    topic = topic_name(run, "trajectories")
    async with open_bus(bus_url) as bus:
        async with bus.consumer([topic], group_id="test-reader") as consumer:
            records = []
            while batch := await consumer.poll(timeout_s=3):
                records.extend(batch)
    records.sort(key=lambda r: r.offset)
    return [decode(r.value, TrajectoryGroup).group_id for r in records]


def assert_judged_once(out_dir: Path, published: list[str]) -> list[dict]:
    """Every step once; no group judged (trained, dropped, filtered, failed) twice; the judged
    groups a prefix of the published ones (none skipped). Returns the ledger."""
    entries = ledger(out_dir)
    assert [e["step"] for e in entries] == list(range(1, len(entries) + 1))
    judged = [g for e in entries for kind in ("trained", "dropped", "filtered", "failed")
              for g in e[kind]]
    assert len(judged) == len(set(judged)), "a group was judged twice"
    assert set(judged) == set(published[:len(judged)]), "a group was skipped"
    return entries
