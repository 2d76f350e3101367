"""KL in the reward for the critic-free estimators, the KL term out of the loss when it is in
the reward, and the adaptive KL controller, through the real Learner on the tiny model.

The batch is tests/integration/conformance.py's (a: r = [1, 0, 0], 2/3/4 tokens; b: r = [1, 1],
2/2 tokens) with behaviour logprobs 0.5 below the learner's own. LoRA starts as the identity
(B = 0), so the reference (adapters off) equals the policy and the k1 KL of the sampling policy
per token is behaviour - reference = -0.5: sum_t k1 = -0.5 n_i, mean over the 5 responses
-0.5 * 13 / 5 = -1.3. The adapted coefficient survives a checkpoint (its meta.json); a process
restart is tests/kafka/test_kl_resume.py.
"""

import logging
import math

import numpy as np

from miles.rl.losses import LossSettings
from miles.trainer import update as update_module
from miles.trainer.checkpoint import save_checkpoint
from miles.trainer.loop import LoopConfig
from miles.trainer.runner import StepRunner
from tests.integration.conformance import (TOKENS, batch_groups, build, preset_config,
                                           process_group)  # noqa: F401
from tests.factories import make_group

SHIFT = -0.5  # behaviour - reference per token
BETA = 0.1


def shifted(groups):
    """`groups` with every behaviour logprob moved by SHIFT."""
    out = []
    for g in groups:
        samples = [s.__class__(**{**s.__dict__, "logprobs": (s.logprobs + SHIFT).astype(
            np.float32)}) for s in g.samples]
        out.append(make_group(prompt_tokens=3, vocab_size=g.vocab_size, samples=samples,
                              group_id=g.group_id, sampling=g.sampling,
                              prompt_token_ids=g.prompt_token_ids))
    return out


def test_rloo_with_the_kl_in_the_reward(model_dir, monkeypatch):
    # RLOO (Ahmadian et al. 2024): R_i = r_i - beta * sum_t k1 = r_i + 0.05 n_i:
    # a: [1.1, 0.15, 0.2] -> A = [1.1 - 0.175, 0.15 - 0.65, 0.2 - 0.625] = [0.925, -0.5, -0.425]
    # b: [1.1, 1.1] -> [0, 0]. IS weight e^0.5 (proximal - behaviour = 0.5, under the cap 2):
    # loss = -e^0.5 * (2 * 0.925 - 3 * 0.5 - 4 * 0.425) / 13 = e^0.5 * 1.35 / 13 = 0.17121;
    # without the KL in the reward A = [1, -0.5, -0.5]: e^0.5 * 1.5 / 13 = 0.19025.
    seen = []
    real = update_module.compute_policy_loss
    monkeypatch.setattr(update_module, "compute_policy_loss",
                        lambda *a, **k: seen.append(k["settings"].kl_coef) or real(*a, **k))
    config = preset_config("rloo", kl_in_reward=True, loss=LossSettings(
        clip_low=0.2, clip_high=0.2, kl_coef=BETA))
    learner = build(model_dir, config)
    metrics = learner.train_step(shifted(batch_groups(learner)))
    assert abs(metrics["trainer/loss"] - math.exp(0.5) * 1.35 / TOKENS) < 1e-4
    assert abs(metrics["trainer/kl_response"] - SHIFT * TOKENS / 5) < 1e-5
    assert metrics["trainer/kl_coef"] == BETA
    assert seen and set(seen) == {0.0}  # finding 2: no KL term in the loss under kl_in_reward


def test_the_same_batch_without_the_kl_in_the_reward(model_dir):
    learner = build(model_dir, preset_config("rloo"))
    metrics = learner.train_step(shifted(batch_groups(learner)))
    assert abs(metrics["trainer/loss"] - math.exp(0.5) * 1.5 / TOKENS) < 1e-4


def test_the_adaptive_controller_moves_the_coefficient(model_dir):
    # Ziegler et al. 2019: e = clip(kl / target - 1, -0.2, 0.2) = clip(-1.3 / 6 - 1) = -0.2;
    # coef = 0.1 * (1 - 0.2 * 5 / 10) = 0.09 after the step (5 responses, horizon 10); fixed
    # (kl_target None): stays 0.1.
    for target, after in ((6.0, 0.09), (None, BETA)):
        config = preset_config("grpo", loss=LossSettings(kl_coef=BETA, kl_target=target,
                                                         kl_horizon=10.0))
        learner = build(model_dir, config)
        metrics = learner.train_step(shifted(batch_groups(learner)))
        assert metrics["trainer/kl_coef"] == BETA  # the step used the initial coefficient
        assert abs(learner.kl.coef - after) < 1e-9
        learner.train_step(shifted(batch_groups(learner)), apply=False)  # a probe: no update
        assert abs(learner.kl.coef - after) < 1e-9


def adaptive_config():
    return preset_config("grpo", loss=LossSettings(kl_coef=BETA, kl_target=6.0, kl_horizon=10.0))


def resumed_learner(model_dir, out, *, with_coef: bool):
    """A learner that trained one step (coefficient 0.1 -> 0.09, as above) and checkpointed it
    (meta.json with its `checkpoint_meta`, or without, as older trainers wrote it), and a fresh
    learner resumed from that checkpoint."""
    trained = build(model_dir, adaptive_config())
    trained.train_step(shifted(batch_groups(trained)))
    meta = {"step": 1, **(trained.kl.checkpoint_meta() if with_coef else {})}
    save_checkpoint(out / "checkpoints", 1, trained.state_dict(), meta)
    resumed = build(model_dir, adaptive_config())
    StepRunner(resumed, LoopConfig(out_dir=out), base_model="tiny").resume()
    return trained, resumed


def test_the_adapted_coefficient_comes_back_from_the_checkpoint(model_dir, tmp_path):
    trained, resumed = resumed_learner(model_dir, tmp_path, with_coef=True)
    assert abs(trained.kl.coef - 0.09) < 1e-9
    assert resumed.kl.coef == trained.kl.coef and resumed.policy_version == 1
    metrics = resumed.train_step(shifted(batch_groups(resumed)))
    assert metrics["trainer/kl_coef"] == trained.kl.coef


def test_a_checkpoint_without_the_coefficient_resumes_from_the_configured_one(
        model_dir, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="miles.trainer.kl_penalty"):
        _, resumed = resumed_learner(model_dir, tmp_path, with_coef=False)
    assert resumed.kl.coef == BETA and resumed.policy_version == 1
    assert "has no kl_coef" in caplog.text and "loss.kl_coef=0.1" in caplog.text
