"""`learner.skip_zero_advantage`: samples that cannot move the gradient get no forward.

A group whose rewards are all equal has advantage 0 on every sample; under an advantage-only
loss (no critic, KL or entropy term) its terms are exactly 0, so leaving it out of the forward
and backward, while the normalisers still count its tokens, must give the same update as
training on it. One rank, fp32, the tiny Llama of `model_dir`.
"""

from dataclasses import replace

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from miles.rl.algorithm import AlgorithmConfig
from miles.rl.losses import LossSettings
from miles.trainer.learner import Learner, LearnerConfig
from miles.trainer.model import LoraSettings
from tests.integration.conformance import process_group, trained_weights  # noqa: F401
from tests.factories import make_group, make_sample

VOCAB = 78
LORA = LoraSettings(r=4, alpha=8)
# adam_eps 1: the update is ~ lr x momentum, linear in the gradients (with a small eps, Adam
# turns a gradient element that is only rounding noise into a full-size step either way)
CONFIG = LearnerConfig(lr=0.5, adam_eps=1.0, max_tokens_per_micro_batch=64, seed=0,
                       precision="fp32")


def group(seed: int, rewards: list[float]):
    samples = [make_sample(5 + i % 3, vocab_size=VOCAB, seed=seed * 100 + i, reward=r)
               for i, r in enumerate(rewards)]
    return make_group(vocab_size=VOCAB, seed=seed, samples=samples,
                      sampling={"temperature": 1.0, "max_new_tokens": 8})


MIXED = [group(0, [1.0, 0.0, 0.0, 1.0]), group(1, [1.0, 1.0, 1.0, 1.0]),
         group(2, [0.0, 0.0, 1.0, 0.0]), group(3, [0.0, 0.0, 0.0, 0.0])]
EQUAL = [group(4, [1.0] * 4), group(5, [0.0] * 4)]


def forwarded(learner: Learner, groups) -> set[str]:
    """The groups with a sample in the train step's micro-batches."""
    return {gid for b in learner.micro_batches(groups, skip_inert=learner.skip_inert)
            for gid, _ in b.sample_ids}


def learners(model_dir, config: LearnerConfig = CONFIG) -> tuple[Learner, Learner]:
    return (Learner(model_dir, replace(config, skip_zero_advantage=True), lora=LORA),
            Learner(model_dir, replace(config, skip_zero_advantage=False), lora=LORA))


def test_skipped_samples_get_no_forward_and_the_update_is_the_same(model_dir):
    skipping, training = learners(model_dir)
    assert forwarded(skipping, MIXED) == {"g-0", "g-2"}
    assert forwarded(training, MIXED) == {"g-0", "g-1", "g-2", "g-3"}
    for _ in range(3):  # LoRA's B starts at 0: later steps move A as well
        with_skip, without = skipping.train_step(MIXED), training.train_step(MIXED)
        assert with_skip["trainer/skipped_samples"] == 8.0
        assert without["trainer/skipped_samples"] == 0.0
        for key in ("trainer/tokens", "trainer/reward_mean"):
            assert with_skip[key] == without[key]
        assert with_skip["trainer/loss"] == pytest.approx(without["trainer/loss"], abs=1e-6)
        assert with_skip["trainer/grad_norm"] == pytest.approx(without["trainer/grad_norm"],
                                                               rel=1e-5)
    after, reference = trained_weights(skipping), trained_weights(training)
    assert any(not torch.equal(v, trained_weights(Learner(model_dir, CONFIG, lora=LORA))[k])
               for k, v in after.items())  # the steps did move the weights
    assert_close(after, reference, rtol=1e-5, atol=1e-6)


def test_a_step_of_only_equal_rewards_still_steps_the_optimizer(model_dir):
    skipping, training = learners(model_dir)
    for learner in (skipping, training):
        learner.train_step(MIXED)  # Adam's moments are non-zero now
    before = trained_weights(skipping)
    metrics = skipping.train_step(EQUAL)
    training.train_step(EQUAL)
    assert metrics["trainer/skipped_samples"] == 8.0
    assert metrics["trainer/grad_norm"] == 0.0
    moved = trained_weights(skipping)
    assert any(not torch.equal(before[k], v) for k, v in moved.items())  # Adam's momentum
    assert_close(trained_weights(skipping), trained_weights(training), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("loss", [LossSettings(entropy_coef=0.01), LossSettings(kl_coef=0.1)])
def test_samples_are_kept_when_a_loss_term_is_not_advantage_weighted(model_dir, loss):
    config = replace(CONFIG, algorithm=AlgorithmConfig(loss=loss))
    learner = Learner(model_dir, config, lora=LORA)
    assert not learner.skip_inert
    assert forwarded(learner, MIXED) == {"g-0", "g-1", "g-2", "g-3"}
    assert learner.train_step(MIXED)["trainer/skipped_samples"] == 0.0


def test_truncated_responses_masked_out_are_skipped_too(model_dir):
    config = replace(CONFIG, algorithm=AlgorithmConfig(mask_truncated=True))
    cut = make_group(vocab_size=VOCAB, seed=6, sampling={"max_new_tokens": 8}, samples=[
        make_sample(6, vocab_size=VOCAB, seed=600 + i, reward=float(i % 2),
                    finish_reason="length" if i == 0 else "stop") for i in range(4)])
    skipping, training = learners(model_dir, config)
    ids = {s for b in skipping.micro_batches([cut], skip_inert=skipping.skip_inert)
           for s in b.sample_ids}
    assert ids == {("g-6", 1), ("g-6", 2), ("g-6", 3)}
    skipping.train_step([cut])
    training.train_step([cut])
    assert_close(trained_weights(skipping), trained_weights(training), rtol=1e-5, atol=1e-6)
    assert np.isfinite(skipping.train_step([cut])["trainer/loss"])
