"""Trainer checkpoints: what a restarted trainer needs to continue exactly where it stopped.

A checkpoint is a folder `<root>/step_<step:08d>/` holding the learner's state (trainable weights,
optimizer, RNG, policy version) written with `torch.distributed.checkpoint` by every rank, plus
`meta.json` from rank 0 with the step, the trainer generation, the trainer's counters, the
adaptive KL coefficient (`kl_coef`: here, not in the state dict, so that older checkpoints still
load) and, per trajectory partition, the next offset to read. The folder is written under a
temporary name; `meta.json` goes in last and lists every file of the folder with its size (the
completeness marker), then the folder is renamed into place. `<root>/latest` names the newest, for people;
the trainer itself never trusts it and scans the folders by step number.

Loading verifies before it trusts: a folder without `meta.json`, with a file missing or of
another size than listed, or one that `torch.distributed.checkpoint` fails to read is skipped
with a warning naming it and why, and moved aside as `<name>.damaged`; the newest checkpoint
that passes is loaded. If folders exist but none loads, the trainer stops with an error rather
than silently starting again at step 1. Sizes, not hashes, are checked: a hash would read every
byte of a 100 GB checkpoint twice; truncation and missing files are what a crash leaves.

Pruning goes by step number and only ever deletes complete checkpoints older than the newest
`KEEP`, so the newest complete one survives any sequence of crashes.

Exactly-once: the offsets in `meta.json` are those just past the last group that went into the
checkpointed weights, so resuming from it neither repeats nor skips a group. Offsets are also
committed to Kafka afterwards, for monitoring only.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from miles.errors import CheckpointError, FencedError
from miles.trainer import distributed

log = logging.getLogger(__name__)
LATEST = "latest"
META = "meta.json"
KEEP = 2  # complete checkpoints kept; older ones are deleted after a new one is in place
DAMAGED_SUFFIX = ".damaged"
_STEP_NAME = re.compile(r"step_(\d{8,})")
# What torch.distributed.checkpoint raises on a damaged folder (CheckpointException is a
# BaseException: it must be named to be caught).
_LOAD_ERRORS = (CheckpointException, OSError, RuntimeError, ValueError, EOFError, KeyError)


def checkpoint_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def checkpoint_step(path: Path) -> int | None:
    """The step of a checkpoint folder's name, None for anything else (staging, damaged)."""
    match = _STEP_NAME.fullmatch(Path(path).name)
    return int(match.group(1)) if match else None


def save_checkpoint(root: Path, step: int, state: dict[str, Any], meta: dict[str, Any], *,
                    fence: Callable[[], None] | None = None) -> Path:
    """Write a checkpoint (a collective: every rank calls it with its own `state`). `fence`
    runs on rank 0 just before the folder is put in place; if it raises FencedError (a newer
    trainer runs) the checkpoint is not published and every rank raises FencedError."""
    final = checkpoint_dir(root, step)
    staging = final.with_name(final.name + ".tmp")
    if distributed.is_main():
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    distributed.barrier()
    dcp.save(state, checkpoint_id=staging)
    distributed.barrier()
    error = None
    if distributed.is_main():
        files = {p.name: p.stat().st_size for p in staging.iterdir() if p.is_file()}
        _write_atomically(staging / META, json.dumps({**meta, "step": step, "files": files},
                                                     indent=2))
        error = _run_fence(fence)
        if error is None:
            shutil.rmtree(final, ignore_errors=True)
            staging.rename(final)
            _write_atomically(Path(root) / LATEST, final.name)
            prune_checkpoints(Path(root))
        else:
            shutil.rmtree(staging, ignore_errors=True)
    if distributed.any_rank(error is not None):
        raise error or FencedError(f"checkpoint {final} not published: rank 0 is fenced")
    return final


def _run_fence(fence: Callable[[], None] | None) -> FencedError | None:
    if fence is None:
        return None
    try:
        fence()
    except FencedError as err:
        return err
    return None


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _by_step(root: Path) -> list[tuple[int, Path]]:
    """Checkpoint folders of `root` (complete or not) by step, newest first."""
    found = [(checkpoint_step(p), p) for p in Path(root).glob("step_*") if p.is_dir()]
    return sorted(((s, p) for s, p in found if s is not None), reverse=True)


def has_checkpoints(root: Path) -> bool:
    """Whether `root` holds a checkpoint folder (complete or not), for `load_newest` to try."""
    return bool(_by_step(root))


def prune_checkpoints(root: Path, keep: int = KEEP) -> list[Path]:
    """Delete complete checkpoints older than the newest `keep`, and staging folders older than
    the newest complete one; never the newest complete checkpoint. Returns what was deleted."""
    complete = [(s, p) for s, p in _by_step(root) if problem_of(p) is None]
    old = [p for _, p in complete[max(keep, 1):]]
    if complete:
        newest = complete[0][0]
        old += [p for p in Path(root).glob("step_*.tmp")
                if (checkpoint_step(p.with_suffix("")) or 0) < newest]
    for path in old:
        shutil.rmtree(path, ignore_errors=True)
    return old


def problem_of(path: Path) -> str | None:
    """Why the checkpoint at `path` cannot be trusted, or None when its files are complete."""
    meta_path = Path(path) / META
    if not meta_path.is_file():
        return f"no {META} (the checkpoint was never completed)"
    try:
        files = json.loads(meta_path.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{META} is unreadable ({type(err).__name__}: {err})"
    for name, size in files.items():
        file = Path(path) / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, {META} lists {size}"
    return None


def newest_meta(root: Path) -> dict[str, Any] | None:
    """The meta of the newest complete checkpoint under `root`, reading no state (audits)."""
    for _, path in _by_step(root):
        if problem_of(path) is None:
            return json.loads((path / META).read_text())
    return None


def load_newest(root: Path, state: dict[str, Any]) -> tuple[Path, dict[str, Any]] | None:
    """Fill `state` in place from the newest checkpoint under `root` that verifies and loads
    (a collective); returns its folder and meta, or None when there is no checkpoint at all.
    Skipped folders are logged and moved aside; CheckpointError if none could be loaded."""
    skipped = []
    for _, path in _by_step(root):
        problem = problem_of(path)
        if problem is None:
            problem = _load(path, state)
        if distributed.any_rank(problem is not None):
            problem = problem or "another rank could not load it"
            log.warning("skipping checkpoint %s: %s", path, problem)
            skipped.append(f"{path.name}: {problem}")
            _move_aside(path)
            continue
        if skipped:
            log.warning("resuming from %s, the newest complete checkpoint", path)
        return path, json.loads((path / META).read_text())
    if skipped:
        raise CheckpointError(f"no checkpoint under {root} could be loaded ({'; '.join(skipped)})"
                              f"; they were moved aside as *{DAMAGED_SUFFIX}. To start afresh "
                              "on purpose, use a new out_dir")
    return None


def _load(path: Path, state: dict[str, Any]) -> str | None:
    try:
        dcp.load(state, checkpoint_id=path)
    except _LOAD_ERRORS as err:
        if isinstance(err, CheckpointException) and err.failures:
            err = next(iter(err.failures.values()))[0]  # (exception, traceback) of a rank
        return f"reading it failed ({type(err).__name__}: {str(err)[:300]})"
    return None


def _move_aside(path: Path) -> None:
    distributed.barrier()
    if distributed.is_main():
        target = path.with_name(path.name + DAMAGED_SUFFIX)
        shutil.rmtree(target, ignore_errors=True)
        path.rename(target)
    distributed.barrier()


def load_checkpoint(path: Path, state: dict[str, Any]) -> dict[str, Any]:
    """Fill `state` in place from the checkpoint at `path` (a collective) and return its meta;
    CheckpointError naming the folder if it is incomplete or cannot be read."""
    problem = problem_of(path) or _load(path, state)
    if problem:
        raise CheckpointError(f"checkpoint {path}: {problem}")
    return json.loads((Path(path) / META).read_text())
