"""The learner's speed and memory switches change nothing but speed and memory: activation
checkpointing, torch.compile of the decoder blocks and CPU offload give the same step as eager;
bf16 mixed precision a close one, with fp32 weights."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
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
    """One step; fp32 unless `precision` is given ("auto" is bf16 on some CPUs)."""
    options = {"precision": "fp32", **options}
    learner = Learner(model_dir, LearnerConfig(lr=1e-3, seed=0, **options), lora=lora)
    groups = [make_group(4, 6, vocab_size=VOCAB, seed=s) for s in range(3)]
    metrics = learner.train_step(groups)
    params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
              for n, p in learner.model.named_parameters() if p.requires_grad}
    distributed.destroy()
    return metrics, params


@pytest.mark.parametrize("lora, precision", [(LORA, "fp32"), (None, "fp32"), (LORA, "bf16")],
                         ids=["lora", "full", "lora-bf16"])
def test_activation_checkpointing_gives_the_same_step(model_dir, lora, precision):
    # bf16 on a CPU: short lines run the short-line attention, and so must the recompute
    plain, before = step(model_dir, lora, precision=precision)
    checkpointed, after = step(model_dir, lora, precision=precision,
                               activation_checkpointing=True)
    assert checkpointed["trainer/loss"] == pytest.approx(plain["trainer/loss"], abs=1e-6)
    for name, value in before.items():
        assert_close(after[name], value, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("lora, sharded_load", [(LORA, False), (None, True)],
                         ids=["lora", "full-sharded-load"])  # (sharded LoRA inits differ)
def test_cpu_offload_gives_the_same_step(model_dir, lora, sharded_load):
    learner = Learner(model_dir, LearnerConfig(cpu_offload=True), lora=lora)
    units = [m for m in learner.model.modules() if isinstance(m, FSDPModule)]
    # FSDP2 internals: every unit got the offload policy
    assert all(isinstance(m._get_fsdp_state()._fsdp_param_group.offload_policy,
                          CPUOffloadPolicy) for m in units if m._get_fsdp_state()._fsdp_param_group)
    distributed.destroy()
    plain, before = step(model_dir, lora)
    offloaded, after = step(model_dir, lora, cpu_offload=True, sharded_load=sharded_load)
    assert offloaded["trainer/loss"] == pytest.approx(plain["trainer/loss"], abs=1e-6)
    for name, value in before.items():
        assert_close(after[name], value, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("lora, algo", [(None, "grpo"), (LORA, "ppo")], ids=["full", "ppo-lora"])
def test_bf16_mixed_precision_keeps_fp32_weights_and_takes_a_close_step(model_dir, lora, algo):
    from miles.config import build
    from miles.rl.algorithm import AlgorithmConfig, preset
    from miles.trainer.precision import cpu_bf16_verdict

    algorithm = build(AlgorithmConfig, {**preset(algo), "ppo_epochs": 1})  # one Adam update
    auto = Learner(model_dir, LearnerConfig(algorithm=algorithm), lora=lora)
    assert auto.dtype == (torch.bfloat16 if cpu_bf16_verdict().bf16 else torch.float32)
    distributed.destroy()
    plain, before = step(model_dir, lora, algorithm=algorithm)
    mixed, after = step(model_dir, lora, algorithm=algorithm, precision="bf16")
    assert mixed["trainer/loss"] != plain["trainer/loss"]  # it did compute in bf16
    assert mixed["trainer/loss"] == pytest.approx(plain["trainer/loss"], rel=0.05, abs=1e-3)
    assert mixed["trainer/grad_norm"] == pytest.approx(plain["trainer/grad_norm"], rel=0.05)
    if algo == "ppo":
        assert mixed["trainer/value_loss"] == pytest.approx(plain["trainer/value_loss"],
                                                            rel=0.05)
    for name, value in before.items():  # Adam moves each weight by ~lr = 1e-3 on a first step
        assert after[name].dtype == torch.float32, name  # master weights stay fp32
        if "lora_A" in name:  # no gradient yet (B = 0): peft drew it in the base's bf16
            assert_close(after[name], value, rtol=8e-3, atol=1e-6, msg=name)
            continue
        difference = (after[name] - value).abs()
        assert float(difference.mean()) < 5e-5, name  # bf16 noise flips only tiny gradients
        assert float(difference.max()) <= 2e-3 + 1e-6, name  # a flip: -lr instead of +lr


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
    assert sharded.policy_version == 1  # a non-finite step would raise
    assert ("trainer/value_loss" in metrics) == (algo == "ppo")
    assert (logits(sharded) - expected).abs().max() > 1e-5  # the step moved the policy


def test_bf16_stores_frozen_weights_in_bf16_and_trained_ones_in_fp32(model_dir):
    from miles.config import load_config
    from miles.rl.algorithm import AlgorithmConfig, preset

    ppo = load_config(AlgorithmConfig, base=preset("ppo"))  # two adapters and a value head
    lora = Learner(model_dir, LearnerConfig(precision="bf16", sharded_load=True, algorithm=ppo),
                   lora=LORA)
    dtypes = {(p.requires_grad, p.dtype) for p in lora.model.parameters()}
    assert dtypes == {(False, torch.bfloat16), (True, torch.float32)}
    distributed.destroy()
    kl = load_config(AlgorithmConfig, base={"loss": {"kl_coef": 0.1}})
    full = Learner(model_dir, LearnerConfig(precision="bf16", algorithm=kl), lora=None)
    assert {p.dtype for p in full.model.parameters()} == {torch.float32}
    assert {p.dtype for p in full.reference.parameters()} == {torch.bfloat16}
    metrics = full.train_step([make_group(4, 6, vocab_size=VOCAB, seed=s) for s in range(3)])
    assert math.isfinite(metrics["trainer/kl_ref"])  # a non-finite step would raise
