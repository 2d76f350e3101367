"""Loss aggregation: per-token terms [B, T] of one micro-batch to one scalar.

Each aggregation divides a local sum by a *global* normaliser (`Normalisers`, counted over every
micro-batch of every rank before the step), so the sum over micro-batches and ranks of the
micro-batch losses is the loss of the whole batch and gradient accumulation is exact.
`AGGREGATIONS` maps config names to them:
- `token_mean`: sum over valid tokens / token count (DAPO's token-level loss, Yu et al. 2025).
- `seq_mean_token_mean`: each row's mean over its valid tokens, summed / row count (the original
  GRPO, Shao et al. 2024; GSPO, Zheng et al. 2025).
- `seq_sum_constant`: sum over valid tokens / (row count * constant), the constant typically the
  maximum response length (Dr. GRPO, Liu et al. 2025): no length bias from the normaliser.

Simplifications:
- Rows without a valid token (idle micro-batches, empty responses) contribute 0 and are not
  counted as rows; a zero count is treated as 1, so an empty batch gives loss 0, not nan.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from miles.config import choose


@dataclass(frozen=True, kw_only=True)
class Normalisers:
    """Global denominators of the aggregations: counted over the whole batch (all micro-batches
    of all ranks), then passed unchanged to the loss of every micro-batch."""

    tokens: float | torch.Tensor  # valid tokens (token_mean)
    rows: float | torch.Tensor  # rows with a valid token (seq_mean_token_mean, seq_sum_constant)
    constant: float | None = None  # tokens per row for seq_sum_constant (max response length)


def count_normalisers(masks: Iterable[torch.Tensor], *, constant: float | None = None
                      ) -> Normalisers:
    """Token and row counts of `masks` (each [B, T] bool, e.g. one per micro-batch).

    Across ranks, all-reduce (sum) `tokens` and `rows` of each rank's result.
    """
    tokens, rows = 0, 0
    for mask in masks:
        tokens += int(mask.sum())
        rows += int(mask.any(dim=-1).sum())
    return Normalisers(tokens=float(tokens), rows=float(rows), constant=constant)


def token_mean(values: torch.Tensor, mask: torch.Tensor, normaliser: float | torch.Tensor
               ) -> torch.Tensor:
    """Sum of `values` ([B, T]) where `mask` ([B, T] bool) is set, divided by `normaliser`.

    With `normaliser` = the token count of the global batch, summing this over micro-batches and
    ranks gives the token mean of the whole batch. Masked-out entries may hold inf/nan.
    """
    return torch.where(mask, values, 0.0).sum() / normaliser


def aggregate_token_mean(values: torch.Tensor, mask: torch.Tensor, normalisers: Normalisers
                         ) -> torch.Tensor:
    """sum over valid tokens of `values` ([B, T]) / global token count."""
    return token_mean(values, mask, _at_least_one(normalisers.tokens))


def aggregate_seq_mean_token_mean(values: torch.Tensor, mask: torch.Tensor,
                                  normalisers: Normalisers) -> torch.Tensor:
    """sum over rows of (row mean of `values` ([B, T]) over its valid tokens) / global row count."""
    row_sums = torch.where(mask, values, 0.0).sum(dim=-1)  # [B]
    row_means = row_sums / mask.sum(dim=-1).clamp(min=1)  # [B]
    return row_means.sum() / _at_least_one(normalisers.rows)


def aggregate_seq_sum_constant(values: torch.Tensor, mask: torch.Tensor,
                               normalisers: Normalisers) -> torch.Tensor:
    """sum over valid tokens of `values` ([B, T]) / (global row count * `normalisers.constant`)."""
    if normalisers.constant is None:
        raise ValueError("seq_sum_constant needs Normalisers.constant (the max response length)")
    return token_mean(values, mask, _at_least_one(normalisers.rows) * normalisers.constant)


def _at_least_one(count: float | torch.Tensor) -> float | torch.Tensor:
    return count.clamp(min=1) if isinstance(count, torch.Tensor) else max(count, 1.0)


Aggregation = Callable[[torch.Tensor, torch.Tensor, Normalisers], torch.Tensor]
"""`aggregate(values [B, T], mask [B, T] bool, normalisers) -> 0-dim loss`."""

AGGREGATIONS: dict[str, Aggregation] = {
    "token_mean": aggregate_token_mean,
    "seq_mean_token_mean": aggregate_seq_mean_token_mean,
    "seq_sum_constant": aggregate_seq_sum_constant,
}
"""Config name -> loss aggregation (see the module docstring)."""


def get_aggregation(name: str) -> Aggregation:
    """The aggregation called `name`; ConfigError naming the valid choices otherwise."""
    return choose(AGGREGATIONS, name, "loss aggregation")
