"""A run's record and names (`miles run`): `out_dir/run.json` (the run's topic name, its bus,
how many prompts were fed, the first held-out accuracy), what a new run clears, what a resumed
one must match, and the bus address the run uses.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from miles.errors import ConfigError

if TYPE_CHECKING:
    from miles.run import RunConfig

RUN_FILE = "run.json"


def bus_url(config: RunConfig) -> str:
    """The embedded bus is durable, in out_dir/bus, so a killed run can resume."""
    return f"embedded://{config.out_dir.resolve() / 'bus'}" if config.embedded else config.bus


def begin(config: RunConfig, *, resume: bool, fresh: bool) -> dict:
    """The run's record in `out_dir/run.json`: a new one (refused where a run already is, unless
    `fresh` wipes it, as the demo does), or with `resume` the killed run's."""
    path = config.out_dir / RUN_FILE
    if resume:
        if not path.exists():
            raise ConfigError(f"--resume: {config.out_dir} holds no run to resume ({RUN_FILE} "
                              "is missing); start one without --resume")
        record = json.loads(path.read_text())
        if record["bus"] != bus_url(config) or record["run"] != config.run:
            raise ConfigError(f"--resume: {config.out_dir} holds run {record['run']!r} on "
                              f"{record['bus']}, not {config.run!r} on {bus_url(config)}")
        return record
    if path.exists() and not fresh:
        raise ConfigError(f"{config.out_dir} already holds run {json.loads(path.read_text())['run']!r}: "
                          "continue it with --resume, or choose another out_dir")
    fresh_out_dir(config.out_dir)
    record = {"run": config.run, "bus": bus_url(config), "fed": 0, "initial_accuracy": None}
    path.write_text(json.dumps(record))
    return record


def fresh_out_dir(out_dir: Path) -> None:
    """Drop what an earlier run left in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("checkpoints", "weights", "bus", "policy"):
        shutil.rmtree(out_dir / name, ignore_errors=True)
    for name in ("metrics.jsonl", "ledger.jsonl", "samples.jsonl", "report.json", "curves.png",
                 "evaluation.jsonl", RUN_FILE):
        (out_dir / name).unlink(missing_ok=True)


def save_record(config: RunConfig, record: dict) -> None:
    (config.out_dir / RUN_FILE).write_text(json.dumps(record))


def with_run_name(config: RunConfig, *, resume: bool = False) -> RunConfig:
    """The run's topic name: `run` if set, else the resumed run's, else the out_dir's name (on
    Kafka, whose topics outlive a run, with the UTC time, so a new run starts clean)."""
    if config.run:
        return config
    path = config.out_dir / RUN_FILE
    if resume and path.exists():
        return replace(config, run=json.loads(path.read_text())["run"])
    name = re.sub(r"[^A-Za-z0-9._-]", "-", config.out_dir.resolve().name) or "run"
    if not config.embedded:
        name += time.strftime("-%Y%m%d-%H%M%S", time.gmtime())
    return replace(config, run=name)
