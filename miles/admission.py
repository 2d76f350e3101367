"""Producer admission control: take a batch only if its groups are fresh enough when trained.

A group generated now with loaded version L is trained roughly when the trainer has consumed
everything already published, i.e. at version
`trainer_version + (in_flight + batch - 1) // groups_per_step`. A producer only takes a batch when
that lag stays within `max_staleness` (`miles.rollout` waits otherwise, and reports it). The
trainer still enforces the bound (several producers can race), this only keeps the waste low.
`TrainerView` is what a producer knows of the trainer: its policy version and how much it has
consumed, from the newest trainer generation's versions and heartbeats.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainerView:
    """What this producer knows of the trainer."""

    policy_version: int = 0  # newest version announced or reported by the newest generation
    consumed: int = 0  # trajectory records the trainer has consumed (its positions summed)
    generation: int = 0  # the newest trainer generation seen; older ones are fenced

    def follow(self, generation: int, policy_version: int) -> bool:
        """Take a policy version announced or reported by trainer `generation`: False (ignored)
        from an older generation; a newer one replaces the view (a resumed trainer may be
        behind); within one generation the version only grows."""
        if generation < self.generation:
            return False
        if generation > self.generation:
            self.generation, self.policy_version = generation, policy_version
        else:
            self.policy_version = max(self.policy_version, policy_version)
        return True


def required_version(*, trainer: TrainerView, in_flight: int, batch: int, groups_per_step: int,
                     max_staleness: int) -> int:
    """The lowest loaded version at which a batch generated now is still fresh enough when it
    is trained."""
    trained_at = trainer.policy_version + (max(in_flight, 0) + batch - 1) // groups_per_step
    return trained_at - max_staleness


def admitted(*, loaded_version: int, trainer: TrainerView, in_flight: int, batch: int,
             groups_per_step: int, max_staleness: int) -> bool:
    """Whether a batch generated now would still be fresh enough when it is trained."""
    return loaded_version >= required_version(
        trainer=trainer, in_flight=in_flight, batch=batch, groups_per_step=groups_per_step,
        max_staleness=max_staleness)


def admissible(*, loaded_version: int, trainer: TrainerView, in_flight: int, most: int,
               groups_per_step: int, max_staleness: int) -> int:
    """How many more groups (at most `most`) a streaming producer can take now: the largest k
    such that the k-th, trained after `in_flight` and the k - 1 before it, is fresh enough."""
    return next((k for k in range(most, 0, -1) if admitted(
        loaded_version=loaded_version, trainer=trainer, in_flight=in_flight, batch=k,
        groups_per_step=groups_per_step, max_staleness=max_staleness)), 0)
