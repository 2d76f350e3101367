"""GSPO (Zheng et al. 2025, "Group sequence policy optimization") through the real
Learner: GRPO advantages, the sequence ratio s_i = (pi / pi_old)^(1/|y_i|) clipped at
[1 - 3e-4, 1 + 4e-4], sequence mean of token means; the behaviour correction at the same
(geometric) sequence level (the `gspo` preset).

A as GRPO: a = [1.4142, -0.7071, -0.7071], b = [0, 0]. With s_i = 1 and IS weight 1 every token
of row i has loss -A_i, so the loss is -(1/5) sum_i A_i = 0; its gradient is -(1/5) A_i / |y_i|
per token of row i (sequence-level: each sequence weighs the same whatever its length).
"""

import math

from torch.testing import assert_close

from tests.integration.conformance import (advantages_by_sample, aggregated_loss, batch_groups,
                                           build, expected, preset_config,
                                           process_group,  # noqa: F401
                                           step_and_check_direction)

A = {"a": [math.sqrt(2), -1 / math.sqrt(2), -1 / math.sqrt(2)], "b": [0.0, 0.0]}


def test_gspo_preset_matches_the_paper(model_dir):
    config = preset_config("gspo")
    assert config.loss.behaviour_level == "geometric"  # finding 6
    learner = build(model_dir, config)
    groups = batch_groups(learner)
    advantages = advantages_by_sample(learner, groups)
    assert_close(advantages, expected(A), atol=1e-5, rtol=0)
    assert abs(aggregated_loss(learner, groups)) < 1e-5
    metrics = step_and_check_direction(learner, groups, advantages)
    assert metrics["trainer/is_weight_mean"] == 1.0
