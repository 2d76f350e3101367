"""DAPO (Yu et al. 2025, Section 3: clip-higher, token-level loss, overlong reward shaping)
through the real Learner (the `dapo` preset; dynamic sampling happens in the loop, before a
step, and has its own tests).

Overlong shaping with max_new_tokens 4 and buffer 2 (Section 3.4): a response of L tokens
gets -penalty * min(1, max(0, L - (4 - 2)) / 2): a (2, 3, 4 tokens) -> 0, -0.5, -1; b -> 0, 0.
Group a's shaped rewards [1, -0.5, -1]: mean -1/6, centred [7/6, -1/3, -5/6], population
std sqrt((49/36 + 4/36 + 25/36) / 3) = 0.84984 -> A = [1.37281, -0.39223, -0.98058]; group b
[1, 1]: A = [0, 0]. Loss (ratio 1) = -(2 * 1.37281 - 3 * 0.39223 - 4 * 0.98058) / 13 = 0.18103.
"""

import math

from torch.testing import assert_close

from tests.integration.conformance import (TOKENS, advantages_by_sample, batch_groups, build,
                                           expected, preset_config, process_group,  # noqa: F401
                                           step_and_check_direction, tokens_weighted_sum)

STD = math.sqrt((49 / 36 + 4 / 36 + 25 / 36) / 3)
A = {"a": [(7 / 6) / STD, (-1 / 3) / STD, (-5 / 6) / STD], "b": [0.0, 0.0]}


def test_dapo_preset_matches_the_paper(model_dir):
    config = preset_config("dapo")
    assert (config.loss.clip_low, config.loss.clip_high) == (0.2, 0.28)
    learner = build(model_dir, config)
    groups = batch_groups(learner)
    advantages = advantages_by_sample(learner, groups)
    assert_close(advantages, expected(A), atol=1e-5, rtol=0)
    metrics = step_and_check_direction(learner, groups, advantages)
    loss = -tokens_weighted_sum(expected(A)) / TOKENS
    assert abs(loss - 0.18103) < 1e-4
    assert abs(metrics["trainer/loss"] - loss) < 1e-4
