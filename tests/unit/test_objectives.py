"""Policy objectives (PPO-clip, dual clip, GSPO, CISPO) against hand-computed tensors."""

import math

import pytest
import torch
from torch.testing import assert_close

from miles.errors import ConfigError
from miles.rl.aggregation import Normalisers, aggregate_seq_mean_token_mean
from miles.rl.losses import LossSettings
from miles.rl.objectives import (OBJECTIVES, ObjectiveSettings, cispo, get_objective, gspo,
                                 ppo_clip)

SETTINGS = ObjectiveSettings(clip_low=0.2, clip_high=0.28)
NAN = float("nan")


def ratios_as_logp(ratios):
    """Current logprobs giving `ratios` against a proximal logprob of 0 (leaf, needs grad)."""
    return torch.tensor(ratios).log().requires_grad_()


def test_ppo_asymmetric_clip():
    logp = ratios_as_logp([[1.5, 0.5, 0.5, 1.5]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    terms = ppo_clip(logp, torch.zeros(1, 4), adv, torch.ones(1, 4, dtype=torch.bool),
                     settings=SETTINGS)
    # -min(r A, clip(r, 0.8, 1.28) A): A>0 clips above 1.28, A<0 clips below 0.8
    assert_close(terms.loss, torch.tensor([[-1.28, -0.5, 0.8, 1.5]]))
    assert terms.clipped.tolist() == [[True, False, True, False]]
    terms.loss.sum().backward()
    assert_close(logp.grad, torch.tensor([[0.0, -0.5, 0.0, 1.5]]))  # -r A where unclipped


def test_ppo_dual_clip_caps_negative_advantage_losses():
    logp = ratios_as_logp([[4.0, 2.0, 4.0, 0.5]])
    adv = torch.tensor([[-1.0, -1.0, 1.0, -1.0]])
    settings = ObjectiveSettings(clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    terms = ppo_clip(logp, torch.zeros(1, 4), adv, torch.ones(1, 4, dtype=torch.bool),
                     settings=settings)
    # r=4, A=-1: PPO loss 4, capped at -3 * A = 3; r=2: 2 < 3 stays; A>0: -1.28 (upper clip);
    # r=0.5, A=-1: lower clip 0.8 < 3
    assert_close(terms.loss, torch.tensor([[3.0, 2.0, -1.28, 0.8]]))
    assert terms.clipped.tolist() == [[True, False, True, True]]
    terms.loss.sum().backward()
    assert_close(logp.grad, torch.tensor([[0.0, 2.0, 0.0, 0.0]]))
    plain = ppo_clip(logp, torch.zeros(1, 4), adv, torch.ones(1, 4, dtype=torch.bool),
                     settings=SETTINGS)
    assert_close(plain.loss[0, 0], torch.tensor(4.0))


def test_gspo_clips_the_geometric_mean_sequence_ratio():
    # rows' log-ratios: [0.1, 0.3] -> s = e^0.2; [-0.2, pad] -> e^-0.2; [0.02, 0.06] -> e^0.04
    log_ratio = torch.tensor([[0.1, 0.3], [-0.2, NAN], [0.02, 0.06]])
    logp = log_ratio.clone().requires_grad_()
    mask = torch.tensor([[True, True], [True, False], [True, True]])
    adv = torch.tensor([[1.0], [-1.0], [2.0]])
    settings = ObjectiveSettings(seq_clip_low=0.1, seq_clip_high=0.15)  # bounds [0.9, 1.15]
    terms = gspo(logp, torch.zeros(3, 2), adv, mask, settings=settings)
    s2 = math.exp(0.04)
    assert_close(terms.ratio.detach()[mask], torch.tensor([math.exp(0.2)] * 2 + [math.exp(-0.2)]
                                                          + [s2] * 2))
    # row 0: -min(1.22, 1.15) = -1.15; row 1 (A<0): -min(-0.82, -0.9) = 0.9; row 2 inside
    assert_close(terms.loss, torch.tensor([[-1.15, -1.15], [0.9, 0.0], [-2 * s2, -2 * s2]]))
    assert terms.clipped.tolist() == [[True, True], [True, False], [False, False]]
    terms.loss.sum().backward()
    # GSPO-token: d s_i,t / d logp_t = s_i, so the gradient is -A s_i on unclipped rows
    assert_close(logp.grad, torch.tensor([[0.0, 0.0], [0.0, 0.0], [-2 * s2, -2 * s2]]))


def test_gspo_token_form_equals_the_sequence_objective_in_value_and_gradient():
    torch.manual_seed(0)
    logp = (-torch.rand(6, 5)).requires_grad_()
    proximal = logp.detach() + 0.05 * torch.randn(6, 5)
    mask = torch.arange(5) < torch.tensor([[5], [3], [1], [4], [2], [5]])
    adv = torch.randn(6, 1)
    settings = ObjectiveSettings(seq_clip_low=0.01, seq_clip_high=0.02)
    terms = gspo(logp, proximal, adv, mask, settings=settings)
    token_loss = aggregate_seq_mean_token_mean(terms.loss, mask, Normalisers(tokens=0, rows=6))
    # the paper's sequence-level objective, differentiated directly
    log_s = torch.where(mask, logp - proximal, 0.0).sum(-1, keepdim=True) / mask.sum(-1,
                                                                                     keepdim=True)
    s = log_s.exp()  # [6, 1]
    seq_loss = -torch.minimum(s * adv, s.clamp(0.99, 1.02) * adv).mean()
    assert terms.clipped.any() and not terms.clipped[mask].all()  # both branches exercised
    assert_close(token_loss, seq_loss)
    assert_close(torch.autograd.grad(token_loss, logp)[0], torch.autograd.grad(seq_loss, logp)[0])


def test_cispo_detached_clipped_weight_times_logp():
    logp = ratios_as_logp([[1.5, 0.5, 1.0]])
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    terms = cispo(logp, torch.zeros(1, 3), adv, torch.ones(1, 3, dtype=torch.bool),
                  settings=ObjectiveSettings(cispo_eps_low=0.2, cispo_eps_high=0.28))
    # weights clip(r, 0.8, 1.28) = 1.28, 0.8, 1; loss = -w A logp
    assert_close(terms.loss, torch.tensor([[-1.28 * math.log(1.5), 0.8 * math.log(0.5), 0.0]]))
    assert terms.clipped.tolist() == [[True, True, False]]
    assert not terms.ratio.requires_grad
    terms.loss.sum().backward()
    # gradient -w A on every token, clipped ones included
    assert_close(logp.grad, torch.tensor([[-1.28, 0.8, -2.0]]))


def test_cispo_bounds_as_in_minimax_m1_no_floor_and_eps_high():
    # Issue 15, finding 7: MiniMax-M1 (Section 3.1) sets no lower bound on the IS weight and
    # tunes eps_high only; cispo reads its own bounds, None meaning "no bound", and the PPO
    # check clip_high >= clip_low does not get in the way.
    settings = LossSettings(objective="cispo", cispo_eps_low=None, cispo_eps_high=0.28)
    logp = ratios_as_logp([[1.5, 0.5, 0.01]])
    terms = cispo(logp, torch.zeros(1, 3), torch.ones(1, 3), torch.ones(1, 3, dtype=torch.bool),
                  settings=settings)
    terms.loss.sum().backward()
    # weights min(r, 1.28) = 1.28, 0.5, 0.01 (no floor): gradient -w A
    assert_close(logp.grad, torch.tensor([[-1.28, -0.5, -0.01]]))
    assert terms.clipped.tolist() == [[True, False, False]]
    uncapped = ObjectiveSettings(cispo_eps_low=None, cispo_eps_high=None)
    logp = ratios_as_logp([[5.0]])
    cispo(logp, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1, dtype=torch.bool),
          settings=uncapped).loss.sum().backward()
    assert_close(logp.grad, torch.tensor([[-5.0]]))  # no cap either: plain IS-weighted REINFORCE


@pytest.mark.parametrize("kwargs, field", [
    (dict(cispo_eps_low=1.5), "cispo_eps_low"),
    (dict(cispo_eps_high=-0.1), "cispo_eps_high"),
])
def test_cispo_bounds_validation(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        ObjectiveSettings(**kwargs)


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_masked_positions_get_zero_loss_and_finite_zero_gradient(name):
    logp = torch.tensor([[-0.5, NAN, float("-inf")], [-1.0, -0.2, NAN]], requires_grad=True)
    proximal = torch.tensor([[-0.4, float("-inf"), NAN], [-1.1, -0.3, 0.0]])
    mask = torch.tensor([[True, False, False], [True, True, False]])
    terms = get_objective(name)(logp, proximal, torch.tensor([[1.0], [-1.0]]), mask,
                                settings=ObjectiveSettings(dual_clip=2.0))
    assert torch.isfinite(terms.loss).all()
    assert (terms.loss[~mask] == 0).all() and not terms.clipped[~mask].any()
    terms.loss.sum().backward()
    assert torch.isfinite(logp.grad).all() and (logp.grad[~mask] == 0).all()
    assert (logp.grad[mask] != 0).all()


def test_registry_and_unknown_objective():
    assert get_objective("ppo") is ppo_clip
    assert set(OBJECTIVES) == {"ppo", "gspo", "cispo"}
    with pytest.raises(ConfigError, match="'sac'.*cispo, gspo, ppo"):
        get_objective("sac")


@pytest.mark.parametrize("kwargs, field", [
    (dict(clip_low=0.2, clip_high=0.1), "clip_high must be >= clip_low"),
    (dict(clip_low=-0.1), "clip_low"),
    (dict(clip_low=1.5, clip_high=2.0), "clip_low"),
    (dict(dual_clip=1.0), "dual_clip"),
    (dict(seq_clip_low=2.0), "seq_clip_low"),
    (dict(seq_clip_high=-1e-4), "seq_clip_high"),
])
def test_settings_validation_names_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        ObjectiveSettings(**kwargs)
