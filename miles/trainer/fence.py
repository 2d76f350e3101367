"""One trainer per run: generations on the output folder, and the fence that stops an old one.

Every trainer start takes the next generation by creating `<out_dir>/generations/<N>`
exclusively (`O_CREAT | O_EXCL`, atomic on local and NFS file systems), so two trainers started
together never share a number. The newest generation owns the run. Before every side effect
that a zombie could do harm with (a ledger line, a weight export, a checkpoint, an announcement)
rank 0 calls `check()`, which raises `FencedError` once a newer generation exists: an orphaned
worker left behind by a killed launcher stops at its next step instead of interleaving with
the trainer that replaced it. Generations also travel on every `WeightVersion` and trainer
`Heartbeat` (`trainer_generation`), and producers follow only the newest one they have seen.

The check is a directory listing, a few microseconds per step. What it cannot close is the
moment between a check and the write it guards (a zombie that checked just before the new
trainer started); every write that matters is guarded right before it, so that window is the
length of one file append or one rename.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from miles.errors import FencedError

GENERATIONS = "generations"


def generations(out_dir: Path) -> list[int]:
    folder = Path(out_dir) / GENERATIONS
    if not folder.is_dir():
        return []
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit())


class Fence:
    """This trainer's generation on `out_dir`."""

    def __init__(self, out_dir: Path, generation: int):
        self.out_dir = Path(out_dir)
        self.generation = generation

    @classmethod
    def take(cls, out_dir: Path) -> Fence:
        """Claim the next generation of `out_dir` (rank 0, once per trainer start)."""
        folder = Path(out_dir) / GENERATIONS
        folder.mkdir(parents=True, exist_ok=True)
        claimed = {"host": socket.gethostname(), "pid": os.getpid(), "started_at": time.time()}
        candidate = max(generations(out_dir), default=0) + 1
        while True:
            try:
                fd = os.open(folder / str(candidate), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                candidate += 1
                continue
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(claimed))
            return cls(out_dir, candidate)

    def newest(self) -> int:
        return max(generations(self.out_dir), default=self.generation)

    def check(self) -> None:
        """Raise FencedError when a newer trainer generation runs on this folder."""
        newest = self.newest()
        if newest > self.generation:
            raise FencedError(
                f"trainer generation {newest} took over {self.out_dir}; this trainer "
                f"(generation {self.generation}) stops without writing anything more")
