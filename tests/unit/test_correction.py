"""Behaviour importance weights (token/sequence/geometric, truncate/mask) and mismatch metrics."""

import math

import pytest
import torch
from torch.testing import assert_close

from miles.errors import ConfigError
from miles.rl.correction import behaviour_weights, logprob_mismatch, mismatch_kl
from miles.rl.ratios import LOG_RATIO_CLAMP

# proximal / behaviour ratios: row 0: 3, 1.5, 0.5; row 1: 0.25, 2, (padding)
PROXIMAL = torch.full((2, 3), -1.0)
BEHAVIOUR = PROXIMAL - torch.tensor([[3.0, 1.5, 0.5], [0.25, 2.0, 1.0]]).log()
BEHAVIOUR[1, 2] = float("nan")
MASK = torch.tensor([[True, True, True], [True, True, False]])
F, T = False, True


def weights(**kwargs):
    return behaviour_weights(PROXIMAL, BEHAVIOUR, MASK, **kwargs)


def test_token_truncate():
    w = weights(level="token", mode="truncate", upper=2.0)
    assert_close(w.weight, torch.tensor([[2.0, 1.5, 0.5], [0.25, 2.0, 0.0]]))
    assert w.truncated.tolist() == [[T, F, F], [F, F, F]]  # 2 is not above the cap
    assert not w.masked.any()


def test_token_mask():
    w = weights(level="token", mode="mask", upper=2.0, lower=0.3)
    assert_close(w.weight, torch.tensor([[0.0, 1.5, 0.5], [0.0, 2.0, 0.0]]))
    assert w.masked.tolist() == [[T, F, F], [T, F, F]]
    assert not w.truncated.any()
    no_lower = weights(level="token", mode="mask", upper=2.0)
    assert_close(no_lower.weight, torch.tensor([[0.0, 1.5, 0.5], [0.25, 2.0, 0.0]]))


def test_sequence_truncate():
    # row products: 3 * 1.5 * 0.5 = 2.25 -> 2; 0.25 * 2 = 0.5
    w = weights(level="sequence", mode="truncate", upper=2.0)
    assert_close(w.weight, torch.tensor([[2.0, 2.0, 2.0], [0.5, 0.5, 0.0]]))
    assert w.truncated.tolist() == [[T, T, T], [F, F, F]]


def test_sequence_mask_drops_whole_rows():
    w = weights(level="sequence", mode="mask", upper=2.0, lower=0.4)
    assert_close(w.weight, torch.tensor([[0.0, 0.0, 0.0], [0.5, 0.5, 0.0]]))
    assert w.masked.tolist() == [[T, T, T], [F, F, F]]
    w = weights(level="sequence", mode="mask", upper=3.0, lower=0.6)
    assert w.masked.tolist() == [[F, F, F], [T, T, F]]


def test_geometric_truncate():
    # geometric means: 2.25 ** (1/3) = 1.31 -> 1.2; 0.5 ** (1/2) = 0.707
    w = weights(level="geometric", mode="truncate", upper=1.2)
    g = math.sqrt(0.5)
    assert_close(w.weight, torch.tensor([[1.2, 1.2, 1.2], [g, g, 0.0]]))
    assert w.truncated.tolist() == [[T, T, T], [F, F, F]]
    w = weights(level="geometric", mode="truncate", upper=2.0)
    assert_close(w.weight[0], torch.full((3,), 2.25 ** (1 / 3)))


def test_weights_are_detached_and_log_ratios_clamped():
    proximal = torch.zeros(1, 2, requires_grad=True)
    behaviour = torch.tensor([[-15.0, -15.0]])  # token log-ratios 15, row sum 30
    big = math.exp(LOG_RATIO_CLAMP)
    mask = torch.ones(1, 2, dtype=torch.bool)
    seq = behaviour_weights(proximal, behaviour, mask, level="sequence", mode="mask", upper=1e12)
    assert_close(seq.weight, torch.full((1, 2), big))
    assert not seq.weight.requires_grad
    token = behaviour_weights(proximal, torch.tensor([[-1000.0, 0.0]]), mask, upper=2.0)
    assert_close(token.weight, torch.tensor([[2.0, 1.0]]))


def test_an_empty_row_gets_no_weight():
    mask = torch.zeros(1, 2, dtype=torch.bool)
    for level in ("token", "sequence", "geometric"):
        w = behaviour_weights(torch.zeros(1, 2), torch.full((1, 2), float("nan")), mask,
                              level=level, mode="mask", upper=2.0, lower=0.5)
        assert_close(w.weight, torch.zeros(1, 2))
        assert not w.masked.any()


def test_unknown_level_or_mode():
    with pytest.raises(ConfigError, match="level"):
        weights(level="row", upper=2.0)
    with pytest.raises(ConfigError, match="mode"):
        weights(mode="clip", upper=2.0)


def test_mismatch_metrics():
    proximal = torch.tensor([[0.0, -1.0]])
    behaviour = torch.tensor([[-math.log(2.0), -1.5]])
    assert_close(logprob_mismatch(proximal, behaviour), torch.tensor([[math.log(2.0), 0.5]]))
    # k3 of r = proximal / behaviour: r - log r - 1
    k3 = lambda r: r - math.log(r) - 1  # noqa: E731
    assert_close(mismatch_kl(proximal, behaviour), torch.tensor([[k3(2.0), k3(math.exp(0.5))]]))
