"""REINFORCE++ (Hu 2025: global advantage normalisation over the batch's tokens)
through the real Learner: A = (r - mean) / std over every response token of the batch, whatever
the group sizes; PPO-clip, token mean (the `reinforce_pp` preset).

Tokens: 6 with r = 1 (a0: 2, b0: 2, b1: 2) and 7 with r = 0 (a1: 3, a2: 4); p = 6/13: mean p,
std sqrt(p (1 - p)) -> A(r=1) = sqrt((1 - p) / p) = sqrt(7/6) = 1.0801, A(r=0) = -sqrt(6/7) =
-0.9258. The token mean of A is 0, so the loss (ratio 1) is 0. Per group (the old behaviour on
groups of different sizes) group b would get 0, and per sample the values would be
(1 - 3/5) / sqrt(0.24) = 0.8165 and -1.2247.

REINFORCE++-baseline (advantage.baseline): group means subtracted first: a: [2/3, -1/3, -1/3],
b: [0, 0]; token mean (4/3 - 1 - 4/3) / 13 = -1/13; the whitened values follow in the test.
"""

import math

from torch.testing import assert_close

from miles.rl.advantages import AdvantageSettings
from tests.integration.conformance import (LENGTHS, TOKENS, advantages_by_sample,
                                           batch_groups, build, expected, preset_config,
                                           process_group,  # noqa: F401
                                           step_and_check_direction, tokens_weighted_sum)

UP, DOWN = math.sqrt(7 / 6), -math.sqrt(6 / 7)
A = {"a": [UP, DOWN, DOWN], "b": [UP, UP]}


def test_reinforce_pp_preset_matches_the_paper(model_dir):
    learner = build(model_dir, preset_config("reinforce_pp"))
    groups = batch_groups(learner)
    advantages = advantages_by_sample(learner, groups)
    assert_close(advantages, expected(A), atol=1e-5, rtol=0)
    assert abs(tokens_weighted_sum(expected(A))) < 1e-9  # zero token mean: loss 0
    metrics = step_and_check_direction(learner, groups, advantages)
    assert abs(metrics["trainer/loss"]) < 1e-5


def test_reinforce_pp_baseline_variant(model_dir):
    learner = build(model_dir, preset_config(
        "reinforce_pp", advantage=AdvantageSettings(baseline=True)))
    groups = batch_groups(learner)
    x = {"a": [2 / 3, -1 / 3, -1 / 3], "b": [0.0, 0.0]}
    values = [v for g in x for v, n in zip(x[g], LENGTHS[g]) for _ in range(n)]  # per token
    mean = sum(values) / TOKENS  # -1/13
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / TOKENS)
    whitened = {g: [(v - mean) / (std + 1e-6) for v in vs] for g, vs in x.items()}
    assert abs(mean + 1 / 13) < 1e-12
    advantages = advantages_by_sample(learner, groups)
    assert_close(advantages, expected(whitened), atol=1e-5, rtol=0)
    step_and_check_direction(learner, groups, advantages)
