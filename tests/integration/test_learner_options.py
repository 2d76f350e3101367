"""The learner's speed and memory switches change nothing but speed and memory: activation
checkpointing and torch.compile of the decoder blocks give the same step as eager."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.testing import assert_close

from miles.trainer import distributed
from miles.trainer.learner import Learner, LearnerConfig
from miles.trainer.model import LoraSettings
from tests.factories import make_group

VOCAB = 78
LORA = LoraSettings(r=4, alpha=8)


@pytest.fixture(autouse=True)
def _process_group():
    yield
    distributed.destroy()


def step(model_dir, lora=LORA, **options) -> tuple[dict, dict[str, torch.Tensor]]:
    learner = Learner(model_dir, LearnerConfig(lr=1e-3, seed=0, **options), lora=lora)
    groups = [make_group(4, 6, vocab_size=VOCAB, seed=s) for s in range(3)]
    metrics = learner.train_step(groups)
    params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
              for n, p in learner.model.named_parameters() if p.requires_grad}
    distributed.destroy()
    return metrics, params


@pytest.mark.parametrize("lora", [LORA, None], ids=["lora", "full"])
def test_activation_checkpointing_gives_the_same_step(model_dir, lora):
    plain, before = step(model_dir, lora)
    checkpointed, after = step(model_dir, lora, activation_checkpointing=True)
    assert checkpointed["trainer/loss"] == pytest.approx(plain["trainer/loss"], abs=1e-6)
    for name, value in before.items():
        assert_close(after[name], value, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.slow
def test_compiled_blocks_give_the_same_step(model_dir):
    plain, before = step(model_dir)
    compiled, after = step(model_dir, compile=True)
    assert compiled["trainer/loss"] == pytest.approx(plain["trainer/loss"], abs=1e-5)
    for name, value in before.items():
        assert_close(after[name], value, atol=1e-5, rtol=1e-4, msg=name)
