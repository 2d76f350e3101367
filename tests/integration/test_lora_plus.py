"""LoRA+ (`learner.lora_plus_ratio`): LoRA's B matrices learn at a multiple of the rate.

Adam's first step moves every weight by about the rate, whatever its gradient's scale, and at
LoRA's init (B = 0) only B has a gradient. So one step at ratio 4 moves B four times as far as
at ratio 1 and leaves A where it was; a second step moves A too, at the plain rate.
"""

import pytest
import torch

from miles.errors import ConfigError
from miles.rl.algorithm import AlgorithmConfig
from miles.trainer.checkpoint import save_checkpoint
from miles.trainer.learner import Learner, LearnerConfig
from miles.trainer.loop import LoopConfig
from miles.trainer.model import LoraSettings, is_lora_b
from miles.trainer.runner import StepRunner
from tests.factories import small_batch
from tests.integration.conformance import process_group, trained_weights  # noqa: F401

LORA = LoraSettings(r=4, alpha=8)


def moves(model_dir, ratio: float, steps: int) -> dict[str, torch.Tensor]:
    """How far each trained weight moved in `steps` steps at `lora_plus_ratio` = ratio."""
    learner = Learner(model_dir, LearnerConfig(lr=1e-3, seed=0, precision="fp32",
                                               lora_plus_ratio=ratio), lora=LORA)
    before = trained_weights(learner)
    for _ in range(steps):
        learner.train_step(small_batch())
    after = trained_weights(learner)
    return {name: after[name] - before[name] for name in before}


def test_b_matrices_move_ratio_times_as_far_on_adams_first_step(model_dir):
    plain, fast = moves(model_dir, 1.0, 1), moves(model_dir, 4.0, 1)
    b_names = [n for n in plain if is_lora_b(n)]
    assert b_names and len(b_names) < len(plain)
    for name in b_names:
        assert plain[name].abs().max() > 0
        torch.testing.assert_close(fast[name], 4.0 * plain[name], rtol=1e-4, atol=1e-9)
    for name in set(plain) - set(b_names):  # A: no gradient while B is 0
        assert not fast[name].any() and not plain[name].any()


def test_a_matrices_keep_the_plain_rate(model_dir):
    plain, fast = moves(model_dir, 1.0, 2), moves(model_dir, 4.0, 2)
    a_names = [n for n in plain if "lora_A" in n]
    assert a_names
    # A's second step follows a B four times as large: a gradient of another scale but, under
    # Adam's first real step for A, a move of the same size per weight (up to eps against
    # gradients near 1e-6); B's moves stay about four times apart
    for name in a_names:
        assert fast[name].abs().max() > 0
        torch.testing.assert_close(fast[name].abs().max(), plain[name].abs().max(), rtol=1e-2,
                                   atol=0)
    for name in (n for n in plain if is_lora_b(n)):
        ratio = fast[name].abs().max() / plain[name].abs().max()
        assert 3.5 < ratio < 4.5


def test_the_critic_adapter_gets_its_own_groups(model_dir):
    config = LearnerConfig(lr=1e-3, critic_lr=5e-4, seed=0, precision="fp32",
                           lora_plus_ratio=8.0, algorithm=AlgorithmConfig(estimator="gae"))
    learner = Learner(model_dir, config, lora=LORA)
    rates = sorted((g["role"], g["lr"]) for g in learner.optimizer.param_groups)
    assert rates == [("actor", 1e-3), ("actor", 8e-3), ("critic", 5e-4), ("critic", 4e-3)]
    counted = sum(len(g["params"]) for g in learner.optimizer.param_groups)
    assert counted == len(learner.actor_params) + len(learner.critic_params)
    assert learner.critic_params


def test_a_checkpoint_brings_back_both_rates_and_adams_state(model_dir, tmp_path):
    config = LearnerConfig(lr=1e-3, seed=0, precision="fp32", lora_plus_ratio=4.0)
    trained = Learner(model_dir, config, lora=LORA)
    trained.train_step(small_batch())
    save_checkpoint(tmp_path / "checkpoints", 1, trained.state_dict(), {"step": 1})
    resumed = Learner(model_dir, config, lora=LORA)
    StepRunner(resumed, LoopConfig(out_dir=tmp_path), base_model="tiny").resume()
    assert sorted(g["lr"] for g in resumed.optimizer.param_groups) == [1e-3, 4e-3]
    trained.train_step(small_batch())
    resumed.train_step(small_batch())
    for (name, a), b in zip(trained_weights(trained).items(), trained_weights(resumed).values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7, msg=name)


def test_a_non_positive_ratio_is_refused():
    with pytest.raises(ConfigError, match="lora_plus_ratio"):
        LearnerConfig(lora_plus_ratio=0.0)
