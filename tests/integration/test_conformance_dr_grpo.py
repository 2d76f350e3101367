"""Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-like training") through the real
Learner: A_i = r_i - mean(r) (no std division), per-sequence token sums over a constant, the
maximum response length (the `dr_grpo` preset: aggregation seq_sum_constant).

Group a, r = [1, 0, 0]: A = [2/3, -1/3, -1/3]; group b: [0, 0]. Ratio and IS weight 1: the loss
is sum_i sum_t (-A_i) / (rows * max_new_tokens) = -(2 * 2/3 - 3/3 - 4/3) / (5 * 4) = 1/20 = 0.05
(the token mean would be 1/13: the constant normaliser is what makes it Dr. GRPO).
"""

from torch.testing import assert_close

from tests.integration.conformance import (advantages_by_sample, aggregated_loss, batch_groups,
                                           build, expected, preset_config,
                                           process_group,  # noqa: F401
                                           step_and_check_direction)

A = {"a": [2 / 3, -1 / 3, -1 / 3], "b": [0.0, 0.0]}


def test_dr_grpo_preset_matches_the_paper(model_dir):
    learner = build(model_dir, preset_config("dr_grpo"))
    groups = batch_groups(learner)
    advantages = advantages_by_sample(learner, groups)
    assert_close(advantages, expected(A), atol=1e-6, rtol=0)
    assert abs(aggregated_loss(learner, groups) - 0.05) < 1e-5
    step_and_check_direction(learner, groups, advantages)
