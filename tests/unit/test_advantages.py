"""GRPO advantages against hand-computed values."""

import math

import torch
from torch.testing import assert_close

from miles.rl.advantages import grpo_advantages

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
