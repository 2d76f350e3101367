"""Decoupled PPO-clip objective, aggregation and metrics against hand-computed tensors."""

import math

import torch
from torch.testing import assert_close

from miles.rl.losses import (LOG_RATIO_CLAMP, decoupled_ppo_clip, k3_kl, policy_loss,
                             token_mean)

CLIP = dict(clip_low=0.2, clip_high=0.28, is_cap=2.0)
# Four tokens with proximal = behaviour = 0 (weight 1): ratio 1.5 / 0.5 with A = +1 / -1.
RATIOS = torch.tensor([[1.5, 0.5, 0.5, 1.5]])  # [1, 4]
ADV = torch.tensor([[1.0, 1.0, -1.0, -1.0]])  # [1, 4]
ZEROS = torch.zeros(1, 4)


def test_clip_on_both_sides_for_positive_and_negative_advantages():
    logp = RATIOS.log().requires_grad_()
    terms = decoupled_ppo_clip(logp, ZEROS, ZEROS, ADV, **CLIP)
    # -min(r A, clip(r, 0.8, 1.28) A): A>0 clips above 1.28, A<0 clips below 0.8
    assert_close(terms.loss, torch.tensor([[-1.28, -0.5, 0.8, 1.5]]))
    assert terms.clipped.tolist() == [[True, False, True, False]]
    assert_close(terms.is_weight, torch.ones(1, 4))
    terms.loss.sum().backward()
    # d(-r A)/d logp = -r A where unclipped; no gradient through the clipped branch
    assert_close(logp.grad, torch.tensor([[0.0, -0.5, 0.0, 1.5]]))


def test_behaviour_importance_weight_is_truncated_and_detached():
    logp = torch.zeros(1, 2, requires_grad=True)
    proximal = torch.zeros(1, 2, requires_grad=True)
    behaviour = torch.tensor([[-math.log(3.0), -math.log(1.5)]])  # raw weights 3 and 1.5
    terms = decoupled_ppo_clip(logp, proximal, behaviour, torch.ones(1, 2), **CLIP)
    assert_close(terms.is_weight, torch.tensor([[2.0, 1.5]]))
    assert terms.truncated.tolist() == [[True, False]]
    assert_close(terms.loss, torch.tensor([[-2.0, -1.5]]))  # w * -(1 * A)
    terms.loss.sum().backward()
    assert_close(logp.grad, torch.tensor([[-2.0, -1.5]]))
    assert proximal.grad is None or torch.all(proximal.grad == 0)


def test_clamp_keeps_huge_log_ratios_finite():
    logp = torch.tensor([[1000.0, -1000.0]], requires_grad=True)
    behaviour = torch.tensor([[-1000.0, 0.0]])
    terms = decoupled_ppo_clip(logp, torch.zeros(1, 2), behaviour, torch.tensor([[-1.0, 1.0]]),
                               **CLIP)
    big = math.exp(LOG_RATIO_CLAMP)
    assert_close(terms.ratio, torch.tensor([[big, math.exp(-LOG_RATIO_CLAMP)]]))
    # token 0: A<0, -min(-e^20, -1.28) = e^20, w = min(e^20, 2); token 1: -min(e^-20, 0.8), w = 1
    assert_close(terms.loss, torch.tensor([[2.0 * big, -math.exp(-LOG_RATIO_CLAMP)]]))
    terms.loss.sum().backward()
    assert torch.isfinite(logp.grad).all()
    assert torch.isfinite(k3_kl(logp.detach(), behaviour)).all()


def test_token_mean_uses_the_given_normaliser_and_ignores_masked_entries():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, float("nan")]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert_close(token_mean(values, mask, 10.0), torch.tensor(0.7))


def test_global_normaliser_makes_accumulation_exact():
    torch.manual_seed(0)
    logp = (-torch.rand(4, 5)).requires_grad_()
    proximal = logp.detach() + 0.1 * torch.randn(4, 5)
    behaviour = proximal + 0.1 * torch.randn(4, 5)
    adv = torch.randn(4, 1)
    mask = torch.rand(4, 5) > 0.3
    n = int(mask.sum())
    full, _ = policy_loss(logp, proximal, behaviour, adv, mask, normaliser=n, **CLIP)
    (full_grad,) = torch.autograd.grad(full, logp)
    parts = [policy_loss(logp[s], proximal[s], behaviour[s], adv[s], mask[s], normaliser=n,
                         **CLIP)[0] for s in (slice(0, 1), slice(1, 4))]
    (split_grad,) = torch.autograd.grad(sum(parts), logp)
    assert_close(sum(parts), full)
    assert_close(split_grad, full_grad)
    terms = decoupled_ppo_clip(logp, proximal, behaviour, adv, **CLIP)
    assert_close(full, terms.loss[mask].mean())


def test_k3_estimator():
    kl = k3_kl(torch.tensor([[math.log(2.0), 0.0]]), torch.zeros(1, 2))
    assert_close(kl, torch.tensor([[2.0 - math.log(2.0) - 1.0, 0.0]]))


def test_metrics_are_masked_sums():
    logp = RATIOS.log()
    behaviour = torch.tensor([[0.0, -math.log(3.0), 0.0, -0.5]])  # weights 1, 3->2, 1, e^0.5
    mask = torch.tensor([[True, True, True, False]])
    loss, m = policy_loss(logp, ZEROS, behaviour, ADV, mask, normaliser=4.0, **CLIP)
    assert_close(loss, torch.tensor((-1.28 - 2 * 0.5 + 0.8) / 4))
    assert_close(m["tokens"], torch.tensor(3.0))
    assert_close(m["loss_sum"], torch.tensor(-1.28 - 1.0 + 0.8))
    assert_close(m["clipped"], torch.tensor(2.0))
    assert_close(m["is_weight_sum"], torch.tensor(4.0))
    assert_close(m["is_weight_max"], torch.tensor(2.0))
    assert_close(m["is_truncated"], torch.tensor(1.0))
    assert_close(m["mismatch_sum"], torch.tensor(math.log(3.0)))
    # k3 of logp - behaviour = log 1.5, log 0.5 + log 3 = log 1.5, log 0.5
    k = lambda r: r - math.log(r) - 1  # noqa: E731
    assert_close(m["kl_behaviour_sum"], torch.tensor(2 * k(1.5) + k(0.5)))
    assert all(not v.requires_grad for v in m.values())
