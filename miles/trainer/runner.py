"""What every trainer rank does, in the same order on all of them: the step messages.

Rank 0 (`miles.trainer.loop.TrainerLoop`) decides each step and broadcasts it as one msgpack
message of the groups' wire bytes (`pack_step`; `distributed.broadcast_bytes`, no pickle); every
rank's `StepRunner` runs it: resume from the newest checkpoint that verifies (rank 0 takes the
next trainer generation first, `miles.trainer.fence`; the adaptive KL coefficient comes back
from its meta.json), train the step (groups that make it fail are bisected out by
`miles.trainer.isolation` and come back for rank 0 to dead-letter), export the new weights to
the store, checkpoint. Ranks other than 0 `follow` until rank 0 broadcasts
an empty message (stop).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import msgpack

from miles.errors import FencedError
from miles.protocol import TrajectoryGroup, WeightVersion, decode
from miles.trainer import distributed
from miles.trainer.checkpoint import has_checkpoints, load_newest, save_checkpoint
from miles.trainer.fence import Fence
from miles.trainer.isolation import Isolation
from miles.trainer.learner import Learner, LearnerConfig
from miles.trainer.model import LoraSettings
from miles.weights.store import (base_model_id, discard_versions_after, prune_versions,
                                 write_version)

if TYPE_CHECKING:
    from miles.trainer.loop import LoopConfig


def pack_step(groups: list[bytes], *, checkpoint: bool, meta: dict) -> bytes:
    return msgpack.packb({"groups": groups, "checkpoint": checkpoint, "meta": meta},
                         use_bin_type=True)


def unpack_step(payload: bytes, groups: list[TrajectoryGroup] | None = None
                ) -> tuple[list[TrajectoryGroup], bool, dict]:
    """The step message's groups (`groups` when the caller already decoded them: rank 0),
    whether to checkpoint, and its meta."""
    message = msgpack.unpackb(payload, raw=False)
    if groups is None:
        groups = [decode(raw, TrajectoryGroup) for raw in message["groups"]]
    return groups, message["checkpoint"], message["meta"]


@dataclass
class StepResult:
    """What a step message did on this rank: the update's metrics ({} when nothing was
    trained), the weight version to announce (rank 0, when the policy changed), and the
    groups (by index in the message) that failed the step, with their reasons."""

    metrics: dict[str, float] = field(default_factory=dict)
    record: WeightVersion | None = None
    failed: dict[int, str] = field(default_factory=dict)


class StepRunner:
    """What every rank does, in the same order on all of them (each call is a collective):
    resume from the newest checkpoint, train a step, export its weights, checkpoint."""

    def __init__(self, learner: Learner, config: LoopConfig, *, base_model: str):
        self.learner = learner
        self.config = config
        self.base_model = base_model
        self.weights_dir = Path(config.out_dir) / "weights"
        self.checkpoints = Path(config.out_dir) / "checkpoints"
        self.fence: Fence | None = None  # rank 0's generation, taken by `resume`
        self.isolation = Isolation()

    @classmethod
    def build(cls, model_dir: str | Path, config: LoopConfig, *, learner: LearnerConfig,
              lora: LoraSettings | None) -> StepRunner:
        """A learner of the checkpoint in `model_dir` and its runner (versions name the
        checkpoint by `base_model_id`)."""
        return cls(Learner(model_dir, learner, lora=lora), config,
                   base_model=base_model_id(model_dir))

    def resume(self) -> tuple[dict | None, WeightVersion | None]:
        """Take the next trainer generation, load the newest checkpoint that verifies (if any),
        drop the weight versions of the lineage it replaces, export the starting weights."""
        if distributed.is_main():
            self.fence = Fence.take(self.config.out_dir)
        meta, found = None, None
        # the state dict to load into is taken only when there is a checkpoint: taking it
        # materialises the optimizer state with a zero-lr step, and a fresh run's Adam would
        # then bias-correct its first updates as later ones (smaller steps)
        if has_checkpoints(self.checkpoints):
            state = self.learner.state_dict()
            found = load_newest(self.checkpoints, state)
        if found is not None:
            meta = found[1]
            self.learner.load_state_dict(state)
            self.learner.kl.resume(meta)
        if distributed.is_main():
            discard_versions_after(self.weights_dir, self.learner.policy_version)
        return meta, self.export(step=int(meta["step"]) if meta else 0)

    def export(self, *, step: int) -> WeightVersion | None:
        """Write the current weights to the store; rank 0 gets the record to announce."""
        if not distributed.is_main():
            self.learner.export_weights(self.weights_dir)  # the gather is collective
            return None
        record = write_version(self.weights_dir, policy_version=self.learner.policy_version,
                               step=step, base_model=self.base_model,
                               write=self.learner.export_weights, fmt=self.learner.weights_format,
                               trainer_generation=self.fence.generation)
        prune_versions(self.weights_dir, self.config.keep_versions)
        return record

    def close(self) -> None:
        """Nothing to release: the learner lives in this process (see `LearnerProcess`)."""

    def check_fence(self) -> None:
        """FencedError on every rank when rank 0 finds a newer generation (a collective)."""
        error = None
        if self.fence is not None:
            try:
                self.fence.check()
            except FencedError as err:
                error = err
        if distributed.any_rank(error is not None):
            raise error or FencedError("rank 0 found a newer trainer generation")

    def step(self, payload: bytes, groups: list[TrajectoryGroup] | None = None
             ) -> StepResult | None:
        """Run one step message broadcast by rank 0; None when the message says stop. Rank 0
        passes the groups it decoded from the bus too (the same as the message's; the other
        ranks decode theirs). Groups that make the step fail are left out of its update
        (`Isolation`) and come back in `failed` (by their index in the message) for rank 0 to
        dead-letter."""
        payload = distributed.broadcast_bytes(payload if distributed.is_main() else None)
        if not payload:
            return None
        groups, checkpoint, meta = unpack_step(payload, groups)
        result = StepResult()
        if groups:
            version = self.learner.policy_version
            outcome = self.isolation.train(self.learner, groups)
            result.metrics, result.failed = outcome.metrics, outcome.failed
            if self.learner.policy_version != version:
                self.check_fence()
                result.record = self.export(step=meta["step"])
        if checkpoint:
            save_checkpoint(self.checkpoints, meta["step"], self.learner.state_dict(), meta,
                            fence=self.fence.check if self.fence else None)
        return result

    def follow(self) -> None:
        """Ranks other than 0: resume, then run steps until rank 0 broadcasts stop (which it
        also does after finding itself fenced)."""
        self.resume()
        while True:
            try:
                if self.step(b"") is None:
                    return
            except FencedError:
                continue
