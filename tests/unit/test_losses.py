"""The composed policy loss against hand-computed tensors."""

import math

import pytest
import torch
from torch.testing import assert_close

from miles.errors import ConfigError
from miles.rl.aggregation import Normalisers, count_normalisers
from miles.rl.losses import (LOG_RATIO_CLAMP, MAX_METRICS, LossSettings, compute_policy_loss,
                             k3_kl, token_mean)

# The default recipe (token PPO-clip, truncated token IS weights, token mean) with these bounds.
RECIPE = LossSettings(clip_low=0.2, clip_high=0.28, is_upper=2.0)
# Four tokens with proximal = behaviour = 0 (weight 1): ratio 1.5 / 0.5 with A = +1 / -1.
RATIOS = torch.tensor([[1.5, 0.5, 0.5, 1.5]])  # [1, 4]
ADV = torch.tensor([[1.0, 1.0, -1.0, -1.0]])  # [1, 4]
ZEROS = torch.zeros(1, 4)
ALL2 = torch.ones(1, 2, dtype=torch.bool)


def recipe_loss(logp, proximal, behaviour, adv, mask, tokens):
    return compute_policy_loss(logp, proximal, behaviour, adv, mask, settings=RECIPE,
                               normalisers=Normalisers(tokens=tokens, rows=1.0))


def test_behaviour_weight_is_truncated_and_nothing_but_the_current_logprobs_get_gradient():
    logp = torch.zeros(1, 2, requires_grad=True)
    proximal = torch.zeros(1, 2, requires_grad=True)
    behaviour = torch.tensor([[-math.log(3.0), -math.log(1.5)]], requires_grad=True)  # w 3, 1.5
    loss, m = recipe_loss(logp, proximal, behaviour, torch.ones(1, 2), ALL2, tokens=1.0)
    assert_close(loss, torch.tensor(-2.0 - 1.5))  # sum of w * -(1 * A), w = min(3, 2), 1.5
    assert_close(m["is_weight_sum"], torch.tensor(3.5))
    assert_close(m["is_truncated"], torch.tensor(1.0))
    logp_grad, proximal_grad, behaviour_grad = torch.autograd.grad(
        loss, (logp, proximal, behaviour), allow_unused=True, materialize_grads=True)
    assert_close(logp_grad, torch.tensor([[-2.0, -1.5]]))
    assert_close(proximal_grad, torch.zeros(1, 2))
    assert_close(behaviour_grad, torch.zeros(1, 2))


def test_clamp_keeps_huge_log_ratios_finite():
    logp = torch.tensor([[1000.0, -1000.0]], requires_grad=True)
    behaviour = torch.tensor([[-1000.0, 0.0]])
    loss, m = recipe_loss(logp, torch.zeros(1, 2), behaviour, torch.tensor([[-1.0, 1.0]]), ALL2,
                          tokens=1.0)
    big = math.exp(LOG_RATIO_CLAMP)
    # ratios e^20 and e^-20; token 0: A<0, -min(-e^20, -1.28) = e^20, w = min(e^20, 2);
    # token 1: -min(e^-20, 0.8), w = 1
    assert_close(loss, torch.tensor(2.0 * big - math.exp(-LOG_RATIO_CLAMP)))
    assert_close(m["is_weight_max"], torch.tensor(2.0))
    (grad,) = torch.autograd.grad(loss, logp)
    assert_close(grad, torch.zeros(1, 2))  # the clamp cuts the gradient beyond it
    assert all(torch.isfinite(v).all() for v in m.values())
    assert torch.isfinite(k3_kl(logp.detach(), behaviour)).all()


def test_token_mean_uses_the_given_normaliser_and_ignores_masked_entries():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, float("nan")]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert_close(token_mean(values, mask, 10.0), torch.tensor(0.7))


def test_recipe_is_the_masked_mean_of_the_formula_and_accumulates_exactly():
    torch.manual_seed(0)
    logp = (-torch.rand(4, 5)).requires_grad_()
    proximal = logp.detach() + 0.2 * torch.randn(4, 5)
    behaviour = proximal + 0.5 * torch.randn(4, 5)
    adv = torch.randn(4, 1)
    mask = torch.rand(4, 5) > 0.3
    n = float(mask.sum())
    full, m = recipe_loss(logp, proximal, behaviour, adv, mask, tokens=n)
    assert m["clipped"] > 0 and m["is_truncated"] > 0  # both bounds are exercised
    (full_grad,) = torch.autograd.grad(full, logp)
    parts = [recipe_loss(logp[s], proximal[s], behaviour[s], adv[s], mask[s], tokens=n)[0]
             for s in (slice(0, 1), slice(1, 4))]
    (split_grad,) = torch.autograd.grad(sum(parts), logp)
    assert_close(sum(parts), full)
    assert_close(split_grad, full_grad)
    # w * -min(r A, clip(r, 0.8, 1.28) A), w = min(proximal / behaviour, 2), mean over the mask
    ratio = (logp - proximal).exp()
    weight = (proximal - behaviour).exp().clamp(max=2.0)
    pg = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.28) * adv)
    assert_close(full, (weight * pg)[mask].mean())


def test_k3_estimator():
    kl = k3_kl(torch.tensor([[math.log(2.0), 0.0]]), torch.zeros(1, 2))
    assert_close(kl, torch.tensor([[2.0 - math.log(2.0) - 1.0, 0.0]]))


def test_metrics_are_masked_sums_and_ignore_non_finite_masked_entries():
    logp = RATIOS.log().clone()
    logp[0, 3] = float("nan")
    behaviour = torch.tensor([[0.0, -math.log(3.0), 0.0, float("-inf")]])  # weights 1, 3->2, 1
    mask = torch.tensor([[True, True, True, False]])
    loss, m = recipe_loss(logp, ZEROS, behaviour, ADV, mask, tokens=4.0)
    # token 0 clipped above (1.28), token 2 clipped below (0.8), token 1 weighted 2
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
    assert all(torch.isfinite(v).all() and not v.requires_grad for v in m.values())


# --- LossSettings and compute_policy_loss ----------------------------------------------------

LOG_HALF = math.log(0.5)
# current = proximal = ln 0.5 everywhere (ratio 1); behaviour gives weights 3 -> 2, 1, 0.5
PROX = torch.full((2, 2), LOG_HALF)
BEHAV = torch.tensor([[LOG_HALF - math.log(3.0), LOG_HALF], [0.0, float("nan")]])
MASK2 = torch.tensor([[True, True], [True, False]])
ADV2 = torch.tensor([[1.0], [-2.0]])
KL_K1 = torch.tensor([[0.5, 1.0], [0.2, 0.0]])  # logp - ref
ENTROPY = torch.tensor([[1.0, 2.0], [3.0, float("nan")]])
NORM = Normalisers(tokens=3.0, rows=2.0)
BASE_KEYS = {"tokens", "loss_sum", "clipped", "is_weight_sum", "is_weight_max",
             "is_truncated", "kl_behaviour_sum", "mismatch_sum"}


def composed(settings, **kwargs):
    logp = PROX.clone().requires_grad_()
    loss, metrics = compute_policy_loss(logp, PROX, BEHAV, ADV2, MASK2, normalisers=NORM,
                                        settings=settings, **kwargs)
    return logp, loss, metrics


def test_composed_loss_hand_computed():
    settings = LossSettings(kl_coef=0.1, kl_kind="k1", entropy_coef=0.01)
    logp, loss, m = composed(settings, ref_logp=PROX - KL_K1, entropy=ENTROPY)
    # per-token -w A: [-2, -1], [1]; token mean over 3; + 0.1 * (0.5+1+0.2)/3 - 0.01 * 6/3
    assert_close(loss, torch.tensor((-2.0 + 0.17 - 0.06) / 3))
    (grad,) = torch.autograd.grad(loss, logp)
    # d(-w A r)/d logp = -w A; d k1 / d logp = 1 (entropy is a constant input here)
    assert_close(grad, torch.tensor([[-2.0 + 0.1, -1.0 + 0.1], [1.0 + 0.1, 0.0]]) / 3)
    k3 = lambda r: r - math.log(r) - 1  # noqa: E731
    expected = {"tokens": 3.0, "loss_sum": -2.0, "clipped": 0.0, "is_weight_sum": 3.5,
                "is_weight_max": 2.0, "is_truncated": 1.0, "is_masked": 0.0,
                "kl_behaviour_sum": k3(3.0) + k3(0.5), "kl_mismatch_sum": k3(3.0) + k3(0.5),
                "mismatch_sum": math.log(3.0) + math.log(2.0), "kl_ref_sum": 1.7,
                "entropy_sum": 6.0,
                # current == proximal: ratio 1, nothing clipped on either side, approx-KL 0
                "clipped_low": 0.0, "clipped_high": 0.0, "kl_proximal_sum": 0.0,
                # the three aggregated terms the loss adds up: -2/3, 0.1 * 1.7/3, -0.01 * 6/3
                "policy_loss": -2.0 / 3, "kl_loss": 0.17 / 3, "entropy_loss": -0.06 / 3}
    assert m.keys() == expected.keys()
    assert_close(m["policy_loss"] + m["kl_loss"] + m["entropy_loss"], loss.detach())
    for key, value in expected.items():
        assert_close(m[key], torch.tensor(value), msg=key)
    assert all(not v.requires_grad for v in m.values())


def test_composed_loss_with_sequence_masking_and_sequence_mean():
    # row ratios 3 (masked: > 2) and 0.5 (kept: >= 0.4); row means: 0 and -0.5 * -2 = 1
    settings = LossSettings(is_level="sequence", is_mode="mask", is_upper=2.0, is_lower=0.4,
                            aggregation="seq_mean_token_mean")
    _, loss, m = composed(settings)
    assert_close(loss, torch.tensor(1.0 / 2))
    assert_close(m["is_masked"], torch.tensor(2.0))
    assert_close(m["is_weight_sum"], torch.tensor(0.5))
    assert "kl_ref_sum" not in m and "entropy_sum" not in m
    assert BASE_KEYS <= m.keys()


def test_measured_but_unweighted_regularisers_do_not_change_the_loss():
    _, plain, _ = composed(LossSettings())
    _, measured, m = composed(LossSettings(), ref_logp=PROX - KL_K1, entropy=ENTROPY)
    assert_close(measured, plain)
    assert "kl_ref_sum" in m and "entropy_sum" in m


def test_coefficients_need_their_inputs():
    with pytest.raises(ValueError, match="ref_logp"):
        composed(LossSettings(kl_coef=0.1))
    with pytest.raises(ValueError, match="entropy"):
        composed(LossSettings(entropy_coef=0.1))


@pytest.mark.parametrize("objective", ["ppo", "gspo", "cispo"])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean",
                                         "seq_sum_constant"])
def test_composed_accumulation_is_exact(objective, aggregation):
    torch.manual_seed(0)
    logp = (-torch.rand(6, 5)).requires_grad_()
    proximal = logp.detach() + 0.1 * torch.randn(6, 5)
    behaviour = proximal + 0.1 * torch.randn(6, 5)
    ref, entropy = logp.detach() + 0.1 * torch.randn(6, 5), torch.rand(6, 5)
    adv = torch.randn(6, 1)
    mask = torch.arange(5) < torch.tensor([[5], [2], [0], [4], [1], [3]])
    settings = LossSettings(objective=objective, aggregation=aggregation, is_level="geometric",
                            is_mode="mask", is_upper=1.1, is_lower=0.9, kl_coef=0.05,
                            entropy_coef=0.01, dual_clip=3.0)
    parts = (slice(0, 2), slice(2, 3), slice(3, 6))
    norm = count_normalisers([mask[s] for s in parts], constant=5.0)

    def loss_of(s):
        return compute_policy_loss(logp[s], proximal[s], behaviour[s], adv[s], mask[s],
                                   normalisers=norm, settings=settings, ref_logp=ref[s],
                                   entropy=entropy[s])

    full, full_m = loss_of(slice(None))
    (full_grad,) = torch.autograd.grad(full, logp)
    split = [loss_of(s) for s in parts]
    (split_grad,) = torch.autograd.grad(sum(loss for loss, _ in split), logp)
    assert_close(sum(loss for loss, _ in split), full)
    assert_close(split_grad, full_grad)
    for key, value in full_m.items():
        reduce = max if key in MAX_METRICS else sum
        assert_close(reduce(m[key] for _, m in split), value, msg=key)


@pytest.mark.parametrize("kwargs, field", [
    (dict(clip_low=0.2, clip_high=0.1), "clip_high must be >= clip_low"),
    (dict(objective="reinforce"), "objective"),
    (dict(aggregation="sum"), "aggregation"),
    (dict(is_level="row"), "is_level"),
    (dict(is_mode="clip"), "is_mode"),
    (dict(is_upper=0.5), "is_upper"),
    (dict(is_lower=-0.5), "is_lower must be"),
    (dict(kl_target=0.0, kl_coef=0.1), "kl_target must be"),
    (dict(kl_target=6.0), "kl_target needs kl_coef"),
    (dict(kl_horizon=0.0), "kl_horizon"),
    (dict(is_mode="mask", is_lower=1.5), "is_lower must be"),
    (dict(kl_coef=-0.1), "kl_coef"),
    (dict(kl_kind="k4"), "kl_kind"),
    (dict(entropy_coef=-1.0), "entropy_coef"),
])
def test_loss_settings_validation_names_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        LossSettings(**kwargs)


def test_clip_fractions_split_by_side_and_the_proximal_kl():
    # ratios 0.7 (A < 0: clipped at 0.8, low side), 1.3 (A > 0: clipped at 1.28, high side),
    # 1.1 (inside the bounds); k3 KL(proximal || current) = r - 1 - log r per token
    ratio = torch.tensor([[0.7, 1.3, 1.1]])
    logp, proximal = ratio.log(), torch.zeros(1, 3)
    adv, mask = torch.tensor([[-1.0, 1.0, 1.0]]), torch.ones(1, 3, dtype=torch.bool)
    _, m = compute_policy_loss(logp, proximal, proximal, adv, mask,
                               normalisers=Normalisers(tokens=3.0, rows=1.0),
                               settings=LossSettings(clip_low=0.2, clip_high=0.28))
    assert (float(m["clipped"]), float(m["clipped_low"]), float(m["clipped_high"])) == (2, 1, 1)
    k3 = sum(r - 1 - math.log(r) for r in (0.7, 1.3, 1.1))
    assert_close(m["kl_proximal_sum"], torch.tensor(k3))
