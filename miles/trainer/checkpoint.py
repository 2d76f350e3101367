"""Trainer checkpoints: what a restarted trainer needs to continue exactly where it stopped.

A checkpoint is a folder `<root>/step_<step:08d>/` holding the learner's state (trainable weights,
optimizer, RNG, policy version) written with `torch.distributed.checkpoint` by every rank, plus
`meta.json` from rank 0 with the step, the policy version and, per trajectory partition, the next
offset to read. The folder is written under a temporary name and renamed, and `<root>/latest`
names it last, so a trainer killed at any point either finds the previous complete checkpoint or
this one, never half of one.

Exactly-once: the offsets in `meta.json` are those just past the last group that went into the
checkpointed weights, so resuming from it neither repeats nor skips a group. Offsets are also
committed to Kafka afterwards, for monitoring only.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp

from miles.trainer import distributed

LATEST = "latest"
META = "meta.json"
KEEP = 2  # complete checkpoints kept; older ones are deleted after a new one is in place


def checkpoint_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def save_checkpoint(root: Path, step: int, state: dict[str, Any], meta: dict[str, Any]) -> Path:
    """Write a checkpoint (a collective: every rank calls it with its own `state`)."""
    final = checkpoint_dir(root, step)
    staging = final.with_name(final.name + ".tmp")
    if distributed.is_main():
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    distributed.barrier()
    dcp.save(state, checkpoint_id=staging)
    distributed.barrier()
    if distributed.is_main():
        (staging / META).write_text(json.dumps({**meta, "step": step}, indent=2))
        shutil.rmtree(final, ignore_errors=True)
        staging.rename(final)
        _write_atomically(Path(root) / LATEST, final.name)
        _prune(Path(root))
    distributed.barrier()
    return final


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _prune(root: Path) -> None:
    complete = sorted(p for p in root.glob("step_*") if not p.name.endswith(".tmp"))
    for old in complete[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(root: Path) -> Path | None:
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    path = Path(root) / pointer.read_text().strip()
    return path if (path / META).is_file() else None


def load_checkpoint(path: Path, state: dict[str, Any]) -> dict[str, Any]:
    """Fill `state` in place from `path` (a collective) and return its meta."""
    dcp.load(state, checkpoint_id=path)
    return json.loads((Path(path) / META).read_text())
