"""Advantage estimators, GAE and its helpers against hand-computed values."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from miles.errors import ConfigError
from miles.rl.advantages import (ADVANTAGE_ESTIMATORS, dr_grpo_advantages, gae_advantages,
                                 get_estimator, grpo_advantages, masked_whiten,
                                 reinforce_pp_advantages, rloo_advantages, token_rewards)

REWARDS = torch.tensor([[1.0, 0.0, 0.0, 1.0],
                        [0.0, 1.0, 2.0, 3.0]])  # [G=2, n=4]


def test_centred_and_scaled_by_population_std():
    # group 0: mean 0.5, std 0.5; group 1: mean 1.5, var (2.25+0.25+0.25+2.25)/4 = 1.25
    s = math.sqrt(1.25)
    expected = torch.tensor([[1.0, -1.0, -1.0, 1.0],
                             [-1.5 / s, -0.5 / s, 0.5 / s, 1.5 / s]])
    assert_close(grpo_advantages(REWARDS, eps=0.0), expected)


def test_eps_is_added_to_the_std():
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5]) / (0.5 + 1e-2)
    assert_close(grpo_advantages(REWARDS[:1], eps=1e-2)[0], expected)


def test_without_std_scaling_only_centres():
    expected = torch.tensor([[0.5, -0.5, -0.5, 0.5], [-1.5, -0.5, 0.5, 1.5]])
    assert_close(grpo_advantages(REWARDS, scale_by_std=False), expected)


def test_equal_rewards_give_zero_advantages():
    out = grpo_advantages(torch.full((1, 3), 0.7))
    assert_close(out, torch.zeros(1, 3))


def test_groups_are_independent():
    changed = REWARDS.clone()
    changed[1] = torch.tensor([5.0, -3.0, 8.0, 0.0])
    assert_close(grpo_advantages(changed)[0], grpo_advantages(REWARDS)[0])
    assert grpo_advantages(REWARDS).shape == (2, 4)


# --- the other critic-free estimators and the registry ---------------------------------------


def test_dr_grpo_only_centres():
    expected = torch.tensor([[0.5, -0.5, -0.5, 0.5], [-1.5, -0.5, 0.5, 1.5]])
    assert_close(dr_grpo_advantages(REWARDS), expected)


def test_rloo_subtracts_the_mean_of_the_others():
    # group 1, r=0: others (1+2+3)/3 = 2; r=1: (0+2+3)/3 = 5/3; r=2: 4/3; r=3: 1
    expected = torch.tensor([[2 / 3, -2 / 3, -2 / 3, 2 / 3], [-2.0, -2 / 3, 2 / 3, 2.0]])
    assert_close(rloo_advantages(REWARDS), expected)


def test_rloo_of_a_single_sample_is_zero():
    assert_close(rloo_advantages(torch.tensor([[3.0], [-1.0]])), torch.zeros(2, 1))


def test_reinforce_pp_normalises_over_the_whole_batch():
    # all 8 rewards: mean 1, deviations 0 -1 -1 0 -1 0 1 2, population var 8/8 = 1
    expected = torch.tensor([[0.0, -1.0, -1.0, 0.0], [-1.0, 0.0, 1.0, 2.0]])
    assert_close(reinforce_pp_advantages(REWARDS, eps=0.0), expected)


def test_reinforce_pp_baseline_centres_per_group_then_normalises_globally():
    # group-centred: +-0.5 (x6), +-1.5 (x2); mean 0, var (6 * 0.25 + 2 * 2.25) / 8 = 0.75
    centred = torch.tensor([[0.5, -0.5, -0.5, 0.5], [-1.5, -0.5, 0.5, 1.5]])
    assert_close(reinforce_pp_advantages(REWARDS, baseline=True, eps=0.0),
                 centred / math.sqrt(0.75))


def test_reinforce_pp_couples_groups_unlike_grpo():
    changed = REWARDS.clone()
    changed[1] = changed[1] * 10
    assert not torch.allclose(reinforce_pp_advantages(changed)[0],
                              reinforce_pp_advantages(REWARDS)[0])


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_every_estimator_has_the_uniform_signature(name):
    out = get_estimator(name)(REWARDS.to(torch.int64))  # integer rewards are accepted
    assert out.shape == (2, 4) and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    # equal rewards give exactly zero, even where a float32 mean of them is inexact (0.7 x 8)
    assert_close(get_estimator(name)(torch.full((2, 8), 0.7)), torch.zeros(2, 8),
                 atol=1e-9, rtol=0)


def test_registry_names_and_unknown_estimator():
    assert get_estimator("grpo") is grpo_advantages
    assert set(ADVANTAGE_ESTIMATORS) == {"grpo", "dr_grpo", "rloo", "reinforce_pp"}
    with pytest.raises(ConfigError, match="'ppo'.*dr_grpo, grpo, reinforce_pp, rloo"):
        get_estimator("ppo")


# --- GAE, token rewards, whitening -----------------------------------------------------------

NAN = float("nan")


def test_gae_hand_computed():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, NAN]])  # [2, 3]
    values = torch.tensor([[0.5, 0.6, 0.7], [1.0, 0.5, NAN]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    # row 0: deltas 0.9*0.6-0.5 = 0.04, 0.9*0.7-0.6 = 0.03, 1-0.7 = 0.3 (V after the end = 0);
    # A2 = 0.3, A1 = 0.03 + 0.72*0.3 = 0.246, A0 = 0.04 + 0.72*0.246 = 0.21712
    # row 1: deltas 0.9*0.5-1 = -0.55, 2-0.5 = 1.5; A1 = 1.5, A0 = -0.55 + 0.72*1.5 = 0.53
    assert_close(adv, torch.tensor([[0.21712, 0.246, 0.3], [0.53, 1.5, 0.0]]))
    assert_close(ret, torch.tensor([[0.71712, 0.846, 1.0], [1.53, 2.0, 0.0]]))


def test_gae_with_gamma_and_lambda_one_gives_monte_carlo_returns():
    rewards = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    values = torch.tensor([[9.0, -3.0, 0.5, 7.0]])
    mask = torch.tensor([[True, True, True, False]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    assert_close(ret, torch.tensor([[6.0, 5.0, 3.0, 0.0]]))
    assert_close(adv, torch.tensor([[-3.0, 8.0, 2.5, 0.0]]))


def reference_gae(rewards, values, lengths, gamma, lam):
    """Plain Python GAE, one row at a time, over the first `lengths[b]` tokens."""
    adv = [[0.0] * len(row) for row in rewards]
    for b, length in enumerate(lengths):
        running = 0.0
        for t in reversed(range(length)):
            next_value = values[b][t + 1] if t + 1 < length else 0.0
            delta = rewards[b][t] + gamma * next_value - values[b][t]
            running = delta + gamma * lam * running
            adv[b][t] = running
    ret = [[a + (v if t < length else 0.0) for t, (a, v) in enumerate(zip(ra, rv))]
           for ra, rv, length in zip(adv, values, lengths)]
    return adv, ret


@settings(max_examples=60, deadline=None)
@given(st.data(), st.integers(1, 4), st.integers(1, 7),
       st.floats(0.0, 1.0), st.floats(0.0, 1.0), st.integers(0, 2**31 - 1))
def test_gae_matches_a_python_reference_loop(data, batch, width, gamma, lam, seed):
    lengths = data.draw(st.lists(st.integers(0, width), min_size=batch, max_size=batch))
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(batch, width, generator=g, dtype=torch.float64)
    values = torch.randn(batch, width, generator=g, dtype=torch.float64)
    mask = torch.arange(width) < torch.tensor(lengths).unsqueeze(1)  # [B, T] right-padded
    adv, ret = reference_gae(rewards.tolist(), values.tolist(), lengths, gamma, lam)
    out_adv, out_ret = gae_advantages(rewards.masked_fill(~mask, NAN),
                                      values.masked_fill(~mask, NAN), mask, gamma=gamma, lam=lam)
    assert_close(out_adv, torch.tensor(adv, dtype=torch.float32))
    assert_close(out_ret, torch.tensor(ret, dtype=torch.float32))


def test_token_rewards_on_the_last_valid_token_minus_kl():
    outcome = torch.tensor([1.0, -1.0, 5.0])
    mask = torch.tensor([[True, True, False], [True, False, False], [False, False, False]])
    assert_close(token_rewards(outcome, mask),
                 torch.tensor([[0.0, 1.0, 0.0], [-1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    kl = torch.tensor([[0.1, 0.2, 9.0], [0.3, 9.0, 9.0], [9.0, 9.0, 9.0]])
    assert_close(token_rewards(outcome, mask, kl, coef=0.5),
                 torch.tensor([[-0.05, 0.9, 0.0], [-1.15, 0.0, 0.0], [0.0, 0.0, 0.0]]))


def test_masked_whiten_uses_only_valid_tokens():
    values = torch.tensor([[1.0, 2.0, NAN], [3.0, 100.0, 100.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    # valid 1, 2, 3: mean 2, population var 2/3
    s = math.sqrt(2 / 3)
    assert_close(masked_whiten(values, mask, eps=0.0),
                 torch.tensor([[-1 / s, 0.0, 0.0], [1 / s, 0.0, 0.0]]))
    assert_close(masked_whiten(values, mask, shift_mean=False, eps=0.0),
                 torch.tensor([[2 - 1 / s, 2.0, 0.0], [2 + 1 / s, 0.0, 0.0]]))
