"""GRPO (Shao et al. 2024, "DeepSeekMath": outcome supervision) through the real
Learner: A_i = (r_i - mean(r)) / std(r) per group, PPO-clip, token mean (the `grpo` preset).

Group a, r = [1, 0, 0]: mean 1/3, population std sqrt(2)/3 = 0.4714 ->
A = [(2/3) / 0.4714, (-1/3) / 0.4714, ...] = [1.4142, -0.7071, -0.7071]; group b, r = [1, 1]:
equal rewards, A = [0, 0]. Ratio and IS weight 1, so the loss is the token mean of -A:
-(2 * 1.4142 - 3 * 0.7071 - 4 * 0.7071) / 13 = 2.1213 / 13 = 0.16318.
"""

import math

from torch.testing import assert_close

from tests.integration.conformance import (TOKENS, advantages_by_sample, batch_groups, build,
                                           expected, preset_config, process_group,  # noqa: F401
                                           step_and_check_direction, tokens_weighted_sum)

A = {"a": [math.sqrt(2), -1 / math.sqrt(2), -1 / math.sqrt(2)], "b": [0.0, 0.0]}


def test_grpo_preset_matches_the_paper(model_dir):
    learner = build(model_dir, preset_config("grpo"))
    groups = batch_groups(learner)
    advantages = advantages_by_sample(learner, groups)
    assert_close(advantages, expected(A), atol=1e-5, rtol=0)
    metrics = step_and_check_direction(learner, groups, advantages)
    loss = -tokens_weighted_sum(expected(A)) / TOKENS
    assert abs(loss - 0.16318) < 1e-4
    assert abs(metrics["trainer/loss"] - loss) < 1e-4
    assert metrics["trainer/is_weight_mean"] == 1.0 and metrics["trainer/clip_frac"] == 0.0
