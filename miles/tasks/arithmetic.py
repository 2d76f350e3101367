"""The built-in task: integer addition such as `37+48=` with an exact-match answer.

Problems are every pair (a, b) with 0 <= a, b <= `max_operand`; a fixed, seeded shuffle puts
`held_out` of them in the test split and the rest in train, so the two never overlap and every
process derives the same split. A response is right when, cut at the end-of-sequence token and
stripped of spaces, it equals the answer.

The answer is the decimal sum written least-significant digit first (`37+48=` -> `58`, i.e. 85)
unless `reverse=False`. Written this way each output digit depends only on two operand digits
and the previous carry, an algorithm a ~1M-parameter model learns quickly (Lee et al. 2023,
"Teaching arithmetic to small transformers"). In the conventional order the first digit already
needs the carry from the units, and the demo's tiny model learns that far more slowly: from the
same kind of warm start (greedy 0.21) RL plateaued near 0.40 (docs/benchmarks.md), while on the
reversed task it gains 25 points in about 20 steps.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

DEFAULT_MAX_OPERAND = 99
DEFAULT_HELD_OUT = 1000


@dataclass(frozen=True, kw_only=True)
class Problem:
    task_id: str
    prompt: str  # the prompt text (a conversation's: `miles.tasks.messages.messages_text`)
    answer: str
    messages: tuple[dict, ...] | None = None  # a conversation (chat-template rendered), if any


def arithmetic_problems(split: str, *, max_operand: int = DEFAULT_MAX_OPERAND,
                        held_out: int = DEFAULT_HELD_OUT, seed: int = 0,
                        reverse: bool = True) -> list[Problem]:
    """The `train` or `test` split of the addition task (answers reversed unless `reverse` is
    False)."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    if not 0 < held_out < len(pairs):
        raise ValueError(f"held_out must be in (0, {len(pairs)}), got {held_out}")
    random.Random(seed).shuffle(pairs)
    chosen = pairs[:held_out] if split == "test" else pairs[held_out:]
    return [Problem(task_id=f"add-{a}-{b}", prompt=f"{a}+{b}=",
                    answer=str(a + b)[::-1] if reverse else str(a + b))
            for a, b in chosen]
