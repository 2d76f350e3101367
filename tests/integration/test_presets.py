"""Every algorithm preset through the real learner (FSDP2, one in-process rank), and PPO's
full fine-tuning mode (separate value model, frozen reference copy)."""

import math
from dataclasses import replace

import pytest
import torch
from torch.distributed.tensor import DTensor

from miles.config import load_config
from miles.rl.algorithm import PRESETS, AlgorithmConfig, preset
from miles.trainer import distributed
from miles.trainer.learner import Learner, LearnerConfig
from miles.trainer.model import LoraSettings
from tests.factories import make_group

VOCAB = 78  # the tiny character tokenizer
LORA = LoraSettings(r=4, alpha=8)


@pytest.fixture(scope="module", autouse=True)
def process_group():
    yield
    distributed.destroy()


def algorithm(name: str, **loss) -> AlgorithmConfig:
    base = preset(name)
    base["loss"] = {**base.get("loss", {}), **loss}
    return load_config(AlgorithmConfig, base=base)


def config(name: str, **loss) -> LearnerConfig:
    return LearnerConfig(lr=1e-3, max_tokens_per_micro_batch=64, seed=0,
                         algorithm=algorithm(name, **loss))


def groups(seed: int = 0) -> list:
    return [make_group(4, 6, vocab_size=VOCAB, seed=seed * 100 + s) for s in range(4)]


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def params(module) -> dict[str, torch.Tensor]:
    return {name: full(p) for name, p in module.named_parameters()}


def changed(before: dict, after: dict) -> set[str]:
    return {name for name in before if not torch.equal(before[name], after[name])}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_trains_a_step(model_dir, name):
    learner = Learner(model_dir, config(name), lora=LORA)
    before = params(learner.model)
    metrics = learner.train_step(groups())
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert learner.policy_version == 1
    moved = changed(before, params(learner.model))
    assert any("lora_B" in n and ".default." in n for n in moved), sorted(moved)
    assert ("trainer/value_loss" in metrics) == (name == "ppo")


def test_ppo_with_a_kl_term_scores_the_disabled_adapter_reference(model_dir):
    ppo = config("ppo", kl_coef=0.1)  # one update a step: the first one starts at the base
    learner = Learner(model_dir, replace(ppo, algorithm=replace(ppo.algorithm, ppo_epochs=1)),
                      lora=LORA)
    assert learner.reference is None  # no extra copy under LoRA
    first = learner.train_step(groups())
    assert first["trainer/kl_ref"] == pytest.approx(0.0, abs=1e-6)  # adapters start as identity
    learner.train_step(groups(1))
    third = learner.train_step(groups(2))
    assert third["trainer/kl_ref"] > 0.0  # the actor moved away from the base


def test_full_fine_tuning_ppo_has_its_own_critic_and_a_frozen_reference(model_dir, tmp_path):
    learner = Learner(model_dir, config("ppo", kl_coef=0.1), lora=None)
    assert learner.critic is not None and learner.reference is not None
    actor, value, reference = params(learner.model), params(learner.critic), \
        params(learner.reference)
    assert all(not p.requires_grad for p in learner.reference.parameters())
    metrics = learner.train_step(groups())
    assert math.isfinite(metrics["trainer/value_loss"]) and "trainer/kl_ref" in metrics
    assert len(changed(actor, params(learner.model))) == len(actor)  # every actor weight
    assert {"value_head.weight", "value_head.bias"} <= changed(value, params(learner.critic))
    assert any(n.startswith("lm.model.layers.") for n in changed(value, params(learner.critic)))
    assert not changed(reference, params(learner.reference))
    # the critic learns: its loss on a fixed batch falls over a few steps
    losses = [learner.train_step(groups(9))["trainer/value_loss"] for _ in range(4)]
    assert losses[-1] < losses[0]
    # its weights, optimizer state and the step count are in the checkpointed state
    state = learner.state_dict()
    assert any(k.startswith("critic.") for k in state["model"])
    assert any(k.startswith("actor.") for k in state["model"])
    assert state["steps"] == 5 and state["policy_version"] == 5


def test_critic_warm_up_trains_only_the_critic(model_dir):
    learner = Learner(model_dir, LearnerConfig(
        lr=1e-3, max_tokens_per_micro_batch=64, seed=0,
        algorithm=load_config(AlgorithmConfig, base={**preset("ppo"), "critic_warmup_steps": 1})),
        lora=LORA)
    before = params(learner.model)
    metrics = learner.train_step(groups())
    moved = changed(before, params(learner.model))
    assert learner.policy_version == 0 and "trainer/policy_loss" not in metrics
    # what was optimised: the critic's loss alone (value_coef 0.5), the actor had no gradient
    assert metrics["trainer/loss"] == pytest.approx(0.5 * metrics["trainer/value_loss"])
    assert metrics["trainer/actor_grad_norm"] == 0.0 < metrics["trainer/critic_grad_norm"]
    assert moved and all("critic" in n or "value_head" in n for n in moved), sorted(moved)
    learner.train_step(groups())
    assert learner.policy_version == 1
