"""`process_logits` and `sampled_logprobs` against hand-computed distributions."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from miles.rl.sampling import process_logits, sampled_logprobs

INF = float("inf")


def log_probs(*probs: float) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs])


def kept(processed: torch.Tensor) -> list[int]:
    return torch.isfinite(processed).nonzero().flatten().tolist()


def test_temperature_divides_logits():
    logits = torch.tensor([1.0, -2.0, 0.5, 4.0])
    assert_close(process_logits(logits, temperature=2.0), torch.tensor([0.5, -1.0, 0.25, 2.0]))
    assert_close(process_logits(logits, temperature=0.5), torch.tensor([2.0, -4.0, 1.0, 8.0]))


def test_top_k_keeps_exactly_the_k_largest():
    logits = torch.tensor([1.0, 3.0, 2.0, 5.0, 4.0])
    assert kept(process_logits(logits, temperature=1.0, top_k=2)) == [3, 4]
    assert kept(process_logits(logits, temperature=1.0, top_k=1)) == [3]
    assert_close(process_logits(logits, temperature=1.0, top_k=2),
                 torch.tensor([-INF, -INF, -INF, 5.0, 4.0]))


def test_top_k_zero_or_at_least_vocab_keeps_all():
    logits = torch.tensor([1.0, 3.0, 2.0])
    assert kept(process_logits(logits, temperature=1.0, top_k=0)) == [0, 1, 2]
    assert kept(process_logits(logits, temperature=1.0, top_k=3)) == [0, 1, 2]
    assert kept(process_logits(logits, temperature=1.0, top_k=10)) == [0, 1, 2]


def test_top_k_keeps_every_token_tied_with_the_kth():
    logits = torch.tensor([1.0, 2.0, 2.0, 0.0])
    assert kept(process_logits(logits, temperature=1.0, top_k=2)) == [1, 2]
    assert kept(process_logits(logits, temperature=1.0, top_k=1)) == [1, 2]


def test_top_k_is_per_row():
    logits = torch.tensor([[1.0, 3.0, 2.0], [9.0, 7.0, 8.0]])  # [2, 3]
    processed = process_logits(logits, temperature=1.0, top_k=1)
    assert kept(processed[0]) == [1]
    assert kept(processed[1]) == [0]


@pytest.mark.parametrize(("top_p", "expected"), [
    (0.45, [0]),  # 0.5 alone reaches 0.45
    (0.75, [0, 1]),  # 0.5 < 0.75, 0.5 + 0.3 reaches it
    (0.85, [0, 1, 2]),  # 0.8 < 0.85, 0.95 reaches it
    (0.99, [0, 1, 2, 3]),
    (1.0, [0, 1, 2, 3]),
])
def test_top_p_keeps_the_smallest_prefix_reaching_p(top_p, expected):
    logits = log_probs(0.5, 0.3, 0.15, 0.05)
    assert kept(process_logits(logits, temperature=1.0, top_p=top_p)) == expected


def test_top_p_works_on_unsorted_logits():
    logits = log_probs(0.05, 0.3, 0.5, 0.15)
    assert kept(process_logits(logits, temperature=1.0, top_p=0.75)) == [1, 2]


def test_top_p_renormalises_the_kept_tokens():
    logits = log_probs(0.5, 0.3, 0.15, 0.05)
    processed = process_logits(logits, temperature=1.0, top_p=0.75)
    assert_close(processed.log_softmax(-1)[:2], log_probs(0.5 / 0.8, 0.3 / 0.8))


def test_top_p_with_ties_keeps_one_tied_token_when_one_suffices():
    logits = log_probs(0.4, 0.4, 0.2)
    assert kept(process_logits(logits, temperature=1.0, top_p=0.5)) == [0, 1]
    one = kept(process_logits(logits, temperature=1.0, top_p=0.3))
    assert len(one) == 1 and one[0] in (0, 1)


def test_top_k_applies_before_top_p():
    logits = log_probs(0.4, 0.3, 0.2, 0.1)
    assert kept(process_logits(logits, temperature=1.0, top_p=0.5)) == [0, 1]
    # top_k=2 renormalises to (4/7, 3/7): 4/7 alone reaches 0.5
    assert kept(process_logits(logits, temperature=1.0, top_k=2, top_p=0.5)) == [0]


def test_temperature_applies_before_top_p():
    logits = log_probs(0.6, 0.3, 0.1)  # at temperature 0.5: probs ~ (0.78, 0.20, 0.02)
    assert kept(process_logits(logits, temperature=1.0, top_p=0.7)) == [0, 1]
    assert kept(process_logits(logits, temperature=0.5, top_p=0.7)) == [0]


def test_sampled_logprobs_is_log_softmax_without_filtering():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11)  # [B, T, V]
    tokens = torch.randint(0, 11, (3, 5))  # [B, T]
    expected = logits.log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    assert_close(sampled_logprobs(logits, tokens, temperature=1.0), expected)
    expected_hot = (logits / 0.7).log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    assert_close(sampled_logprobs(logits, tokens, temperature=0.7), expected_hot)


def test_sampled_logprobs_of_a_filtered_token_is_minus_inf():
    logits = log_probs(0.5, 0.3, 0.15, 0.05)
    lp = sampled_logprobs(logits, torch.tensor(3), temperature=1.0, top_p=0.75)
    assert lp.item() == -INF


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [
    (1.0, 0, 1.0), (0.7, 20, 0.9), (0.3, 0, 0.5), (1.5, 5, 1.0), (1e-3, 0, 1.0), (1.0, 1, 0.01)])
def test_sampled_tokens_always_have_finite_logprobs(temperature, top_k, top_p):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=generator) * 4  # [B, V]
    processed = process_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    for _ in range(5):
        tokens = torch.multinomial(processed.softmax(-1), 1, generator=generator).squeeze(-1)
        lp = sampled_logprobs(logits, tokens, temperature=temperature, top_k=top_k, top_p=top_p)
        assert torch.isfinite(lp).all()
        assert (lp <= 0).all()
