"""KL estimators and the entropy from logits against hand-computed and exact values."""

import math

import pytest
import torch
from torch.testing import assert_close

from miles.errors import ConfigError
from miles.rl.kl import entropy_from_logits, k3_kl, kl_estimate

LN2 = math.log(2.0)
LOGP = torch.tensor([[math.log(0.5), math.log(0.25)]])
REF = torch.tensor([[math.log(0.25), math.log(0.5)]])  # x = ref - logp = -ln 2, ln 2


def test_estimators_hand_computed():
    assert_close(kl_estimate(LOGP, REF, "k1"), torch.tensor([[LN2, -LN2]]))
    assert_close(kl_estimate(LOGP, REF, "k2"), torch.tensor([[0.5 * LN2**2, 0.5 * LN2**2]]))
    assert_close(kl_estimate(LOGP, REF, "k3"), torch.tensor([[0.5 + LN2 - 1, 2 - LN2 - 1]]))


def exact(p_logits, ref_logits, kind):
    """E_p[estimate] and its gradient w.r.t. p's logits, samples held fixed (the loss gradient)."""
    logp = torch.log_softmax(p_logits, -1)
    ref = torch.log_softmax(ref_logits, -1)
    value = (logp.exp().detach() * kl_estimate(logp, ref, kind)).sum()
    return value, torch.autograd.grad(value, p_logits)[0]


def test_expectations_and_loss_gradients_under_the_sampling_policy():
    torch.manual_seed(0)
    p_logits = torch.randn(5, requires_grad=True)
    ref_logits = torch.randn(5)
    ref = ref_logits.softmax(-1)

    def kl(a, b):
        return (a * (a.log() - b.log())).sum()

    reverse, = torch.autograd.grad(kl(p_logits.softmax(-1), ref), p_logits)
    forward, = torch.autograd.grad(kl(ref, p_logits.softmax(-1)), p_logits)
    p = p_logits.softmax(-1).detach()
    k1, k1_grad = exact(p_logits, ref_logits, "k1")
    k3, k3_grad = exact(p_logits, ref_logits, "k3")
    _, k2_grad = exact(p_logits, ref_logits, "k2")
    assert_close(k1, kl(p, ref).detach())  # k1 and k3: unbiased for KL(p || ref)
    assert_close(k3, kl(p, ref).detach())
    assert_close(k1_grad, torch.zeros(5))  # as losses: k1 -> 0, k2 -> reverse, k3 -> forward
    assert_close(k2_grad, reverse)
    assert_close(k3_grad, forward)


def test_k3_kl_is_k3_from_the_behaviour_side():
    logp, behaviour = torch.tensor([[LN2, 0.0]]), torch.zeros(1, 2)
    assert_close(k3_kl(logp, behaviour), torch.tensor([[2.0 - LN2 - 1.0, 0.0]]))
    assert_close(k3_kl(LOGP, REF), kl_estimate(REF, LOGP, "k3"))


def test_huge_log_ratios_stay_finite():
    out = kl_estimate(torch.tensor([0.0, -1000.0]), torch.tensor([-1000.0, 0.0]), "k3")
    assert torch.isfinite(out).all()


def test_unknown_kind():
    with pytest.raises(ConfigError, match="'k4'.*k1, k2, k3"):
        kl_estimate(LOGP, REF, "k4")


def test_entropy_hand_computed():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0],
                            [math.log(0.5), math.log(0.25), math.log(0.25), float("-inf")]]])
    # uniform over 4: ln 4; (0.5, 0.25, 0.25): 0.5 ln 2 + 2 * 0.25 ln 4 = 1.5 ln 2
    assert_close(entropy_from_logits(logits), torch.tensor([[2 * LN2, 1.5 * LN2]]))


def test_entropy_matches_torch_and_has_finite_gradients_with_filtered_logits():
    torch.manual_seed(0)
    logits = (5 * torch.randn(2, 3, 7)).to(torch.bfloat16)
    out = entropy_from_logits(logits)
    assert out.shape == (2, 3) and out.dtype == torch.float32
    expected = torch.distributions.Categorical(logits=logits.float()).entropy()
    assert_close(out, expected)
    filtered = torch.randn(2, 3, 7).masked_fill(torch.arange(7) >= 3, float("-inf"))
    filtered.requires_grad_()
    entropy_from_logits(filtered).sum().backward()
    assert torch.isfinite(filtered.grad).all()
