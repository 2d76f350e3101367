"""Value rules of an episode's arrays (1.4): `loss_mask`, the versions it implies, `turn_ends`.

A sample with a `loss_mask` is a multi-turn episode: its mask says which tokens the policy
sampled (1) and which the environment's observations added (0). The rules, checked by the codec
on encode and decode like every other wire rule (`check_episode`), so that a trainer, a replay
and a foreign reader can rely on them without checking:
- every `loss_mask` entry is 0 or 1, and at least one is 1 (an episode trains something);
- `versions` is -1 (`OBSERVATION_VERSION`) exactly where the mask is 0, and >= 0 where it is 1;
- `turn_ends` (with or without a mask) is strictly increasing, starts >= 1 and ends at T; each
  turn opens with a policy token, and within a turn the policy's tokens come before the
  observation's (the mask rises from 0 to 1 only where a turn starts).

Simplification: the rules run per episode sample (a handful of numpy calls each), not over the
group's concatenated arrays like `miles.protocol.arrays`: single-turn samples, the hot path,
pay nothing.
"""

from __future__ import annotations

import numpy as np

from miles.errors import CodecError
from miles.protocol.limits import OBSERVATION_VERSION


def check_episode(sample, path: str) -> None:
    """Raise `CodecError` naming `path.<field>` where `sample`'s episode arrays break a rule;
    `sample.versions` of a sample without a mask are left to the group-wide VERSIONS rule."""
    mask = sample.loss_mask
    if mask is not None:
        check_mask(mask, f"{path}.loss_mask")
        check_versions(sample.versions, mask, f"{path}.versions")
    if sample.turn_ends is not None:
        check_turn_ends(sample.turn_ends, mask, len(sample.response_token_ids),
                        f"{path}.turn_ends")


def check_mask(mask: np.ndarray, path: str) -> None:
    """Entries 0 or 1, at least one 1."""
    high = int(mask.max())
    if high > 1:
        i = int(np.flatnonzero(mask > 1)[0])
        raise CodecError(path, f"value {int(mask[i])} at index {i} is not 0 or 1")
    if high == 0:
        raise CodecError(path, "no policy token (every entry is 0)")


def check_versions(versions: np.ndarray, mask: np.ndarray, path: str) -> None:
    """-1 exactly on observation tokens, >= 0 on the policy's."""
    policy = mask != 0
    bad = np.flatnonzero(np.where(policy, versions < 0, versions != OBSERVATION_VERSION))
    if bad.size:
        i = int(bad[0])
        if policy[i]:
            raise CodecError(path, f"negative policy version {int(versions[i])} at index {i} "
                                   "(a policy token, loss_mask 1)")
        raise CodecError(path, f"version {int(versions[i])} at index {i} must be "
                               f"{OBSERVATION_VERSION} (an observation token, loss_mask 0)")


def check_turn_ends(ends: np.ndarray, mask: np.ndarray | None, length: int, path: str) -> None:
    """Strictly increasing, first >= 1, last == `length`; turns shaped policy-then-observation."""
    if int(ends[0]) < 1:
        raise CodecError(path, f"first turn end {int(ends[0])} must be >= 1")
    steps = np.flatnonzero(np.diff(ends) <= 0)
    if steps.size:
        k = int(steps[0]) + 1
        raise CodecError(path, f"not strictly increasing: {int(ends[k])} at index {k} after "
                               f"{int(ends[k - 1])}")
    if int(ends[-1]) != length:
        raise CodecError(path, f"last turn end {int(ends[-1])} must equal the response length "
                               f"{length}")
    if mask is None:
        return
    starts = np.concatenate([[0], ends[:-1]])  # [K]
    opens = np.flatnonzero(mask[starts] == 0)
    if opens.size:
        k = int(opens[0])
        raise CodecError(path, f"turn {k} (tokens {int(starts[k])}..{int(ends[k])}) starts with "
                               "an observation token; a turn opens with the policy's tokens")
    rises = np.flatnonzero(np.diff(mask.astype(np.int8)) == 1) + 1  # a 0 then a 1
    stray = rises[~np.isin(rises, starts)]
    if stray.size:
        i = int(stray[0])
        k = int(np.searchsorted(ends, i, side="right"))
        raise CodecError(path, f"policy token at index {i} follows an observation token inside "
                               f"turn {k}; a turn is the policy's tokens, then the observation's")
