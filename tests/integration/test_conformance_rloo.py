"""RLOO (Ahmadian et al. 2024, "Back to basics") through the real Learner:
A_i = r_i - mean of the other n - 1 rewards; PPO-clip, token mean (the `rloo` preset).

Group a, r = [1, 0, 0]: A = [1 - 0, 0 - 1/2, 0 - 1/2] = [1, -0.5, -0.5]; group b, r = [1, 1]:
[0, 0]. Ratio and IS weight 1: loss = -(2 * 1 - 3 * 0.5 - 4 * 0.5) / 13 = 1.5 / 13 = 0.11538.
"""

from torch.testing import assert_close

from tests.integration.conformance import (TOKENS, advantages_by_sample, batch_groups, build,
                                           expected, preset_config, process_group,  # noqa: F401
                                           step_and_check_direction, tokens_weighted_sum)

A = {"a": [1.0, -0.5, -0.5], "b": [0.0, 0.0]}


def test_rloo_preset_matches_the_paper(model_dir):
    learner = build(model_dir, preset_config("rloo"))
    groups = batch_groups(learner)
    advantages = advantages_by_sample(learner, groups)
    assert_close(advantages, expected(A), atol=1e-6, rtol=0)
    metrics = step_and_check_direction(learner, groups, advantages)
    loss = -tokens_weighted_sum(expected(A)) / TOKENS
    assert abs(loss - 0.11538) < 1e-4
    assert abs(metrics["trainer/loss"] - loss) < 1e-4
