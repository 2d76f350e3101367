"""A fresh run's first update is Adam's first step.

The trainer's start-up looks for a checkpoint to resume from. Taking the learner's state dict
to load one into materialises the optimizer state with a zero-lr step (torch's helper), so
Adam's step count would start at 1 and bias-correct the first updates as later ones: the first
step 0.74x its size, the fifth 0.96x. With no checkpoint to load, start-up must leave the
optimizer untouched.
"""

import torch

from miles.trainer.learner import Learner, LearnerConfig
from miles.trainer.loop import LoopConfig
from miles.trainer.model import LoraSettings
from miles.trainer.runner import StepRunner
from tests.integration.conformance import process_group, trained_weights  # noqa: F401
from tests.factories import small_batch

LORA = LoraSettings(r=4, alpha=8)
CONFIG = LearnerConfig(lr=1e-2, seed=0, precision="fp32")


def test_starting_without_a_checkpoint_leaves_adam_at_its_first_step(model_dir, tmp_path):
    started = Learner(model_dir, CONFIG, lora=LORA)
    meta, version = StepRunner(started, LoopConfig(out_dir=tmp_path),
                               base_model="tiny").resume()
    assert meta is None and version.policy_version == 0
    assert not started.optimizer.state  # nothing materialised
    plain = Learner(model_dir, CONFIG, lora=LORA)
    for _ in range(2):
        started.train_step(small_batch())
        plain.train_step(small_batch())
    steps = {float(s["step"]) for s in started.optimizer.state.values()}
    assert steps == {2.0}
    assert all(torch.equal(a, b) for a, b in zip(trained_weights(started).values(),
                                                  trained_weights(plain).values()))
