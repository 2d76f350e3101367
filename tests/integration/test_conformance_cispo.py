"""CISPO (MiniMax 2025, "MiniMax-M1", Section 3.1) through the real Learner: GRPO advantages,
loss -sg(clip(r, 1 - eps_low, 1 + eps_high)) A logp per token, no lower bound, token mean (the
`cispo` preset).

A as GRPO: a = [1.4142, -0.7071, -0.7071], b = [0, 0]. At ratio 1 the weight is 1, so the loss
is sum_i sum_t (-A_i logp_i,t) / 13 with the learner's own logprobs (written out below), and the
gradient -A_i / 13 on every token: REINFORCE, no token's gradient dropped by a clip.
"""

import math

from torch.testing import assert_close

from tests.integration.conformance import (TOKENS, advantages_by_sample, batch_groups, build,
                                           expected, logprob_sums, preset_config,
                                           process_group,  # noqa: F401
                                           step_and_check_direction)

A = {"a": [math.sqrt(2), -1 / math.sqrt(2), -1 / math.sqrt(2)], "b": [0.0, 0.0]}


def test_cispo_preset_matches_the_paper(model_dir):
    config = preset_config("cispo")
    assert (config.loss.cispo_eps_low, config.loss.cispo_eps_high) == (None, 1.0)  # finding 7
    learner = build(model_dir, config)
    groups = batch_groups(learner)
    advantages = advantages_by_sample(learner, groups)
    assert_close(advantages, expected(A), atol=1e-5, rtol=0)
    sums = logprob_sums(learner, groups)  # sum_t logp_i,t before the step
    loss = sum(-expected(A)[k] * sums[k] for k in sums) / TOKENS
    metrics = step_and_check_direction(learner, groups, advantages)
    assert abs(metrics["trainer/loss"] - loss) < 1e-4
