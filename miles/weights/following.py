"""Which announced weight versions a producer follows, and which it may fall back to.

Each trainer start takes the next generation (docs/wire-format.md). A producer follows the newest
generation it has seen: a version from a newer generation is followed even when its policy
version is lower (a trainer resumed from an older checkpoint), one from an older generation is
refused (a fenced trainer), and within one generation versions only go forward (the same
version again is a re-announcement).

Simplifications, chosen on purpose:
- Only the newest generation's last `RECENT_VERSIONS` versions are kept: enough to fall back
  past a few missing or broken files, and never a fenced generation's weights.
- A version is identified by (generation, policy version); the weights an engine starts with are
  (0, 0), so any announced version of a newer generation or a higher policy version replaces them.
"""

from __future__ import annotations

from collections import deque

from miles.protocol import WeightVersion

RECENT_VERSIONS = 8  # versions kept to fall back to when the newest cannot be loaded


def lineage(version: WeightVersion) -> tuple[int, int]:
    """(trainer generation, policy version): what orders two versions."""
    return version.trainer_generation, version.policy_version


class Announcements:
    """The followed versions of the newest trainer generation seen, oldest first."""

    def __init__(self, keep: int = RECENT_VERSIONS):
        self.generation = 0  # the newest trainer generation seen (versions or heartbeats)
        self.recent: deque[WeightVersion] = deque(maxlen=keep)

    def refusal(self, version: WeightVersion) -> str | None:
        """Why `version` is not followed, or None when it is."""
        if version.trainer_generation < self.generation:
            return (f"announced by trainer generation {version.trainer_generation}, fenced by "
                    f"generation {self.generation}")
        newest = self.recent[-1] if self.recent else None
        if (newest is not None and newest.trainer_generation == version.trainer_generation
                and version.policy_version < newest.policy_version):
            return (f"announced after version {newest.policy_version} (versions only go "
                    "forward)")
        return None

    def fence(self, generation: int) -> bool:
        """Note that trainer `generation` exists; True when it is newer than any seen (the
        older generations' versions are dropped)."""
        if generation <= self.generation:
            return False
        self.generation = generation
        self.recent.clear()
        return True

    def add(self, version: WeightVersion) -> None:
        """Keep a version `refusal` accepted; a re-announcement replaces its earlier record."""
        self.fence(version.trainer_generation)
        if self.recent and lineage(self.recent[-1]) == lineage(version):
            self.recent.pop()
        self.recent.append(version)

    def newer_than(self, loaded: tuple[int, int]) -> list[WeightVersion]:
        """The kept versions that would replace weights of lineage `loaded`, newest first."""
        return [v for v in reversed(self.recent) if lineage(v) > loaded]
