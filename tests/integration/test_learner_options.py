"""The learner's speed and memory switches change nothing but speed and memory: activation
checkpointing and torch.compile of the decoder blocks give the same step as eager."""

from __future__ import annotations

from dataclasses import replace

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


def logits(learner, model=None) -> torch.Tensor:
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
    with torch.no_grad():
        return (model or learner.model)(input_ids=ids, use_cache=False).logits


@pytest.mark.parametrize("algo, lora", [("grpo", LORA), ("ppo", LORA), ("grpo", None)],
                         ids=["grpo-lora", "ppo-lora", "grpo-full-kl"])
def test_sharded_load_starts_from_the_checkpoint_and_trains(model_dir, algo, lora):
    from miles.config import load_config
    from miles.rl.algorithm import AlgorithmConfig, preset

    base = {**preset(algo), "loss": {**preset(algo).get("loss", {}), "kl_coef": 0.1}}
    config = LearnerConfig(lr=1e-3, seed=0, algorithm=load_config(AlgorithmConfig, base=base))
    plain = Learner(model_dir, config, lora=lora)
    expected = logits(plain)
    distributed.destroy()
    sharded = Learner(model_dir, replace(config, sharded_load=True), lora=lora)
    assert_close(logits(sharded), expected, atol=1e-6, rtol=1e-6)  # LoRA B = 0: the base
    if sharded.reference is not None:
        assert_close(logits(sharded, sharded.reference), expected, atol=1e-6, rtol=1e-6)
    metrics = sharded.train_step([make_group(4, 6, vocab_size=VOCAB, seed=s) for s in range(3)])
    assert metrics["trainer/skipped_step"] == 0.0 and sharded.policy_version == 1
    assert ("trainer/value_loss" in metrics) == (algo == "ppo")
    assert (logits(sharded) - expected).abs().max() > 1e-5  # the step moved the policy
