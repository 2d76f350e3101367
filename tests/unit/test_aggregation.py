"""Loss aggregations and their global normalisers against hand-computed values."""

import pytest
import torch
from torch.testing import assert_close

from miles.errors import ConfigError
from miles.rl.aggregation import (AGGREGATIONS, Normalisers, aggregate_seq_mean_token_mean,
                                  aggregate_seq_sum_constant, aggregate_token_mean,
                                  count_normalisers, get_aggregation)

NAN = float("nan")
VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, NAN, NAN], [NAN, NAN, NAN]])  # [3, 3]
MASK = torch.tensor([[True, True, True], [True, False, False], [False, False, False]])


def test_count_normalisers_counts_tokens_and_non_empty_rows():
    other = torch.tensor([[True, True, False, False]])
    assert count_normalisers([MASK, other], constant=8.0) == Normalisers(tokens=6.0, rows=3.0,
                                                                         constant=8.0)


def test_token_mean():
    n = count_normalisers([MASK])  # 4 tokens, 2 rows (the empty row does not count)
    assert_close(aggregate_token_mean(VALUES, MASK, n), torch.tensor(10.0 / 4))


def test_seq_mean_token_mean():
    n = count_normalisers([MASK])
    assert_close(aggregate_seq_mean_token_mean(VALUES, MASK, n), torch.tensor((2.0 + 4.0) / 2))


def test_seq_sum_constant():
    n = count_normalisers([MASK], constant=5.0)
    assert_close(aggregate_seq_sum_constant(VALUES, MASK, n), torch.tensor(10.0 / (2 * 5.0)))
    with pytest.raises(ValueError, match="constant"):
        aggregate_seq_sum_constant(VALUES, MASK, count_normalisers([MASK]))


@pytest.mark.parametrize("name", sorted(AGGREGATIONS))
def test_global_normalisers_make_accumulation_exact(name):
    torch.manual_seed(0)
    values = torch.randn(6, 5, requires_grad=True)
    mask = torch.arange(5) < torch.tensor([[5], [2], [0], [4], [1], [3]])
    parts = (slice(0, 2), slice(2, 3), slice(3, 6))
    n = count_normalisers([mask[s] for s in parts], constant=5.0)
    aggregate = get_aggregation(name)
    full = aggregate(values, mask, n)
    (full_grad,) = torch.autograd.grad(full, values)
    split = sum(aggregate(values[s], mask[s], n) for s in parts)
    (split_grad,) = torch.autograd.grad(split, values)
    assert_close(split, full)
    assert_close(split_grad, full_grad)
    reference = {"token_mean": values[mask].mean(),
                 "seq_mean_token_mean": torch.stack([values[b, mask[b]].mean() for b in range(6)
                                                     if mask[b].any()]).mean(),
                 "seq_sum_constant": values[mask].sum() / (5 * 5.0)}[name]
    assert_close(full, reference)


@pytest.mark.parametrize("name", sorted(AGGREGATIONS))
def test_empty_batch_gives_zero_not_nan(name):
    mask = torch.zeros(2, 3, dtype=torch.bool)
    out = get_aggregation(name)(torch.full((2, 3), NAN), mask, count_normalisers([mask],
                                                                                 constant=4.0))
    assert_close(out, torch.tensor(0.0))


def test_registry_and_unknown_aggregation():
    assert get_aggregation("token_mean") is aggregate_token_mean
    assert set(AGGREGATIONS) == {"token_mean", "seq_mean_token_mean", "seq_sum_constant"}
    with pytest.raises(ConfigError, match="'sum'.*seq_mean_token_mean, seq_sum_constant"):
        get_aggregation("sum")
