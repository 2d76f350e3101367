"""Finding the groups that make a train step fail, so the others are still trained.

`Isolation.train(learner, groups)` runs the step; when it fails (`StepError`: a non-finite loss
or gradient norm, or a data error, see `learner.DATA_ERRORS`; the learner changed nothing) the
batch is bisected with probes (`train_step(apply=False)`: forwards, backwards and checks, no
update) until each failing group is alone, then the rest is trained in one update. So a trainer
step is still at most one `train_step` and `policy_version` still counts updates; the failing
groups come back with their reasons for rank 0 to dead-letter.

Every rank runs this with the same groups and gets the same verdicts (the learner agrees on
every failure collectively), so every rank makes the same probes in the same order: the
decisions need no message of their own.

Bounds and the line between data and bugs:
- A part whose halves each pass alone but that fails whole is probed once more: passing now, it
  was a transient failure (nothing is dead-lettered); failing again, its groups fail only
  together and are all dead-lettered with that reason. Probes per failed step are therefore at
  most about three per node of the bisection tree: O(failing groups x log2(batch)).
- The rest is retried at most `MAX_ROUNDS` times (a probe does not step between mini-batches,
  so the real step can still fail); then the `StepError` propagates.
- More than `MAX_FAILED_IN_A_ROW` groups failing with none trained in between is not data but a
  bug or a diverged model: `StepError` propagates and the trainer stops.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from miles.errors import StepError
from miles.protocol import TrajectoryGroup

log = logging.getLogger(__name__)

MAX_ROUNDS = 3  # isolation rounds on one step's batch before its StepError propagates
MAX_FAILED_IN_A_ROW = 8  # failing groups with none trained in between: a bug, not data


@dataclass
class Outcome:
    """One trainer step: the update's metrics ({} without an update), the indices (into the
    step's groups) that were in the update, and those that failed with their reasons."""

    metrics: dict[str, float] = field(default_factory=dict)
    trained: list[int] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)


class Isolation:
    """Trains steps, isolating failing groups; counts failures in a row across steps."""

    def __init__(self) -> None:
        self.failed_in_a_row = 0

    def train(self, learner, groups: list[TrajectoryGroup]) -> Outcome:
        outcome = Outcome(trained=list(range(len(groups))))
        for _ in range(MAX_ROUNDS):
            try:
                outcome.metrics = learner.train_step([groups[i] for i in outcome.trained])
                break
            except StepError as err:
                found = self._bisect(learner, groups, outcome.trained, str(err))
            outcome.failed.update(found)
            outcome.trained = [i for i in outcome.trained if i not in found]
            if not outcome.trained:
                break
        else:
            raise StepError(f"the step still fails after {MAX_ROUNDS} isolation rounds")
        self._account(outcome, groups)
        return outcome

    def _account(self, outcome: Outcome, groups: list[TrajectoryGroup]) -> None:
        for index, reason in outcome.failed.items():
            log.warning("group %s fails the step: %s", groups[index].group_id, reason)
        if outcome.trained:
            self.failed_in_a_row = 0
            return
        self.failed_in_a_row += len(outcome.failed)
        if self.failed_in_a_row > MAX_FAILED_IN_A_ROW:
            raise StepError(f"{self.failed_in_a_row} groups in a row failed their steps and "
                            "none trained: a bug or a diverged model, not bad data; last: "
                            f"{list(outcome.failed.values())[-1]}")

    def _bisect(self, learner, groups: list[TrajectoryGroup], indices: list[int],
                reason: str) -> dict[int, str]:
        """The groups of `indices` (a batch that failed with `reason`) that make it fail."""
        if len(indices) == 1:
            return {indices[0]: reason}
        half = len(indices) // 2
        found: dict[int, str] = {}
        for part in (indices[:half], indices[half:]):
            failure = probe(learner, groups, part)
            if failure is not None:
                found.update(self._bisect(learner, groups, part, failure))
        if found:
            return found
        again = probe(learner, groups, indices)
        if again is None:
            log.warning("a step failure did not recur (%s): treated as transient", reason)
            return {}
        return {i: f"fails only together with {len(indices) - 1} other groups: {again}"
                for i in indices}


def probe(learner, groups: list[TrajectoryGroup], indices: list[int]) -> str | None:
    """Why a step on these groups fails, or None when it would pass (nothing is updated)."""
    try:
        learner.train_step([groups[i] for i in indices], apply=False)
    except StepError as err:
        return str(err)
    return None
