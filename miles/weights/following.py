"""Which announced weight versions a follower (producer, evaluator) loads, and when they count.

Each trainer start takes the next generation (docs/wire-format.md). A follower follows the
newest generation it has seen: a version from a newer generation is followed even when its
policy version is lower (a trainer resumed from an older checkpoint), one from an older
generation is refused (a fenced trainer), and within one generation versions only go forward
(the same version again is a re-announcement).

An announced version is only a *candidate* until it verifies: its file is inside the weight
store, present, of the announced size and sha256, and the engine loads it. Only then does it
count: it becomes the followed version (the "versions only go forward" bound) and fences older
generations. A candidate that fails any check is dropped and changes nothing (docs/
control-plane.md): a forged announcement of version 2**31-1 cannot freeze a run by raising the
bound. A candidate that may load later stays a candidate and is retried, still changing
nothing: its file is missing (it may appear: a slow shared file system), or the engine could
not be reached (a vLLM server restarting), which says nothing about the version.

Simplifications, chosen on purpose:
- At most `RECENT_VERSIONS` candidates are kept (by arrival; older ones are forgotten): enough
  to fall back past a few missing files, and a flood of forged announcements evicts itself.
- A version is identified by (generation, policy version); the weights an engine starts with are
  (0, 0), so any announced version of a newer generation or a higher policy version replaces them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from pathlib import Path

from miles.errors import EngineUnavailableError, MissingWeightsError
from miles.protocol import WeightVersion

RECENT_VERSIONS = 8  # candidates kept to fall back to when the newest cannot be loaded


@dataclass(frozen=True, kw_only=True)
class FollowConfig:
    """Where a follower's weights may come from, and whose announcements it believes."""

    store: Path = Path("runs/demo/weights")  # the trainer's out_dir/weights; URIs outside: refused
    public_key: Path | None = None  # trainer's Ed25519 public key (PEM); None: unsigned accepted


def lineage(version: WeightVersion) -> tuple[int, int]:
    """(trainer generation, policy version): what orders two versions."""
    return version.trainer_generation, version.policy_version


def may_load_later(err: Exception) -> bool:
    """Whether a version that failed to load with `err` stays a candidate (see above)."""
    return isinstance(err, (MissingWeightsError, EngineUnavailableError))


class Announcements:
    """The followed version and the candidates that may replace it."""

    def __init__(self, keep: int = RECENT_VERSIONS):
        self.generation = 0  # the newest trainer generation seen (verified versions, heartbeats)
        self.followed: WeightVersion | None = None  # the newest version that verified
        self.candidates: deque[WeightVersion] = deque(maxlen=keep)  # announced, not verified

    def refusal(self, version: WeightVersion) -> str | None:
        """Why `version` is not a candidate, or None when it is."""
        if version.trainer_generation < self.generation:
            return (f"announced by trainer generation {version.trainer_generation}, fenced by "
                    f"generation {self.generation}")
        newest = self.followed
        if (newest is not None and newest.trainer_generation == version.trainer_generation
                and version.policy_version < newest.policy_version):
            return (f"announced after version {newest.policy_version} (versions only go "
                    "forward)")
        return None

    def fence(self, generation: int) -> bool:
        """Note that trainer `generation` exists (a verified version or heartbeat); True when it
        is newer than any seen (the older generations' candidates are dropped)."""
        if generation <= self.generation:
            return False
        self.generation = generation
        kept = [v for v in self.candidates if v.trainer_generation >= generation]
        self.candidates.clear()
        self.candidates.extend(kept)
        return True

    def offer(self, version: WeightVersion) -> None:
        """Keep a version `refusal` accepted as a candidate (a re-announcement of the followed
        version, or of a candidate, changes nothing)."""
        if self.followed is not None and lineage(version) <= lineage(self.followed):
            return
        self.drop(version)
        self.candidates.append(version)

    def drop(self, version: WeightVersion) -> None:
        """Forget the candidate of `version`'s lineage (it failed a check)."""
        kept = [v for v in self.candidates if lineage(v) != lineage(version)]
        self.candidates.clear()
        self.candidates.extend(kept)

    def verified(self, version: WeightVersion) -> None:
        """`version` verified and is in use: it is followed now, its generation fences older
        ones, and the candidates it replaces are dropped."""
        self.fence(version.trainer_generation)
        self.followed = version
        kept = [v for v in self.candidates if lineage(v) > lineage(version)]
        self.candidates.clear()
        self.candidates.extend(kept)

    def newer_than(self, loaded: tuple[int, int]) -> list[WeightVersion]:
        """The candidates that would replace weights of lineage `loaded`, newest first."""
        return sorted((v for v in self.candidates if lineage(v) > loaded), key=lineage,
                      reverse=True)
