"""Value rules of wire arrays: token-id ranges, logprob signs, finiteness, version ranges.

A `ValueRule` is a whole-array test of one or two numpy reductions (`min`/`max`, which propagate
NaN), never a Python loop over elements. The arrays of all samples of a group are concatenated
and tested at once: numpy's per-call overhead on 16 small arrays costs more than the copy. Only
when a test fails are the arrays searched one by one, to name the offending element in the
`CodecError` (`samples[3].logprobs: logprob 0.5 at index 7 is positive`).
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from miles.errors import CodecError

# `ndarray.max()`/`.min()` without the Python wrapper numpy puts around them (~20% of a reduction
# over a group's arrays)
_max, _min = np.maximum.reduce, np.minimum.reduce
_UINT32 = np.dtype("<u4")


@dataclass(frozen=True, kw_only=True)
class ValueRule:
    """A constraint on every element of an array."""

    holds: Callable[[np.ndarray], bool]
    """Fast whole-array test (non-empty array)."""
    violations: Callable[[np.ndarray], np.ndarray]
    """Boolean mask of offending elements; computed only after `holds` failed."""
    explain: Callable[[np.generic, int], str]
    """Reason naming an offending value and its index."""

    def check(self, values: np.ndarray, path: str) -> None:
        """Raise `CodecError(path, ...)` at the first element breaking the rule."""
        self.check_all([values], lambda _: path)

    def check_all(self, arrays: Sequence[np.ndarray], path_of: Callable[[int], str]) -> None:
        """`check` each array (`path_of(i)` names arrays[i]), testing their concatenation once."""
        # bytes.join concatenates a list of small arrays about twice as fast as np.concatenate
        whole = arrays[0] if len(arrays) == 1 else np.frombuffer(b"".join(arrays), arrays[0].dtype)
        if whole.size == 0 or self.holds(whole):
            return
        for k, values in enumerate(arrays):
            bad = np.flatnonzero(self.violations(values))
            if bad.size:
                i = int(bad[0])
                raise CodecError(path_of(k), self.explain(values[i], i))
        raise AssertionError("a ValueRule's holds() and violations() disagree")  # a bug here


@lru_cache(maxsize=64)  # a run has one or two vocab sizes; saves building the rule per record
def token_ids_rule(vocab_size: int) -> ValueRule:
    """Every token id in [0, vocab_size) (ids are int32)."""
    return ValueRule(
        # Read as uint32, negative int32 ids become >= 2**31 > vocab_size: one max() checks both.
        holds=lambda ids: _max(ids.view(_UINT32)) < vocab_size,  # ids are "<i4"
        violations=lambda ids: (ids < 0) | (ids >= vocab_size),
        explain=lambda v, i: f"token id {v} at index {i} outside [0, {vocab_size})",
    )


def _logprob_problem(value: np.generic, index: int) -> str:
    problem = "positive" if np.isfinite(value) else "not finite"
    return f"logprob {value} at index {index} is {problem}"


LOGPROBS = ValueRule(
    holds=lambda lp: _max(lp) <= 0.0 and _min(lp) > -np.inf,  # NaN fails max <= 0
    violations=lambda lp: ~(np.isfinite(lp) & (lp <= 0.0)),
    explain=_logprob_problem,
)
"""Behaviour logprobs: finite and <= 0."""

VERSIONS = ValueRule(
    holds=lambda v: _min(v) >= 0,
    violations=lambda v: v < 0,
    explain=lambda v, i: f"negative policy version {v} at index {i}",
)
"""Per-token policy versions: >= 0."""

FINITE = ValueRule(
    holds=lambda x: _max(x) < np.inf and _min(x) > -np.inf,  # NaN fails both
    violations=lambda x: ~np.isfinite(x),
    explain=lambda v, i: f"value {v} at index {i} is not finite",
)
"""Any float array: no NaN or infinity."""
