"""Several optimizer updates per rollout batch through the real learner (FSDP2, one in-process
rank, tiny Llama): the clip fires, the proximal policy and old values are scored once in eval
mode, the actor and the critic are clipped apart, and the reported loss is what was optimised."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.testing import assert_close

from miles.config import load_config
from miles.rl.algorithm import AlgorithmConfig, preset
from miles.trainer import distributed, learner as learner_module, update
from miles.trainer.batching import make_micro_batches
from miles.trainer.learner import Learner, LearnerConfig
from miles.trainer.model import LoraSettings
from tests.factories import make_group

VOCAB = 78  # the tiny character tokenizer
LORA = LoraSettings(r=4, alpha=8)


@pytest.fixture(scope="module", autouse=True)
def process_group():
    yield
    distributed.destroy()


def algorithm(name: str, loss: dict | None = None, **fields) -> AlgorithmConfig:
    base = {**preset(name), **fields}
    base["loss"] = {**base.get("loss", {}), **(loss or {})}
    return load_config(AlgorithmConfig, base=base)


def make_learner(model_dir, algo: AlgorithmConfig, lora=LORA, **options) -> Learner:
    return Learner(model_dir, LearnerConfig(**{"lr": 1e-3, "max_tokens_per_micro_batch": 64,
                                               "seed": 0, "algorithm": algo, **options}),
                   lora=lora)


def groups(seed: int = 0, n: int = 4) -> list:
    return [make_group(4, 6, vocab_size=VOCAB, seed=seed * 100 + s) for s in range(n)]


# -- finding 1: the clip fires with several updates per batch --------------------------------

@pytest.mark.parametrize("name, fields", [("ppo", {}), ("dapo", {"dynamic_sampling": False}),
                                          ("ppo", {"ppo_epochs": 1}),
                                          ("dapo", {"mini_batches": 1,
                                                    "dynamic_sampling": False})],
                         ids=["ppo", "dapo", "ppo-one-update", "dapo-one-update"])
def test_the_clip_fires_only_with_several_updates_per_batch(model_dir, name, fields):
    """At a high lr the later updates move the policy past the clip bounds; with one update per
    batch the ratio is exactly 1 (GRPO's mu = 1) and nothing can clip."""
    learner = make_learner(model_dir, algorithm(name, **fields), lr=5e-2)
    steps = [learner.train_step(groups(seed)) for seed in range(3)]
    clipped = sum(m["trainer/clip_frac"] for m in steps)
    for m in steps:
        assert m["trainer/clip_frac"] == pytest.approx(
            m["trainer/clip_frac_low"] + m["trainer/clip_frac_high"])
    if learner.updates_per_step(4) == 1:
        assert clipped == 0.0 and all(m["trainer/approx_kl_prox"] == 0.0 for m in steps)
        assert all(m.get("trainer/value_clip_frac", 0.0) == 0.0 for m in steps)
        return
    assert steps[0]["trainer/updates"] == learner.updates_per_step(4) == 4  # 4x1 / 16 -> 4 groups
    assert clipped > 0.0 and all(m["trainer/approx_kl_prox"] > 0.0 for m in steps)
    if name == "ppo":
        assert sum(m["trainer/value_clip_frac"] for m in steps) > 0.0
    assert learner.policy_version == 3  # one published version per step, whatever the updates


def test_the_proximal_policy_and_old_values_are_scored_once_before_the_first_update(
        model_dir, monkeypatch):
    """3 epochs x 2 mini-batches = 6 updates: every update sees the same proximal logprobs and
    old values, and at the first update the ratio current / proximal is exactly 1."""
    learner = make_learner(model_dir, algorithm("ppo", ppo_epochs=3, mini_batches=2))
    prepares, calls = [], []
    real_prepare, real_loss = learner_module.prepare, update.compute_policy_loss

    def counting_prepare(*args, **kwargs):
        prepares.append(kwargs["proximal"])
        return real_prepare(*args, **kwargs)

    def recording_loss(logp, proximal, *args, **kwargs):
        calls.append((logp.detach().clone(), proximal))
        return real_loss(logp, proximal, *args, **kwargs)

    monkeypatch.setattr(learner_module, "prepare", counting_prepare)
    monkeypatch.setattr(update, "compute_policy_loss", recording_loss)
    metrics = learner.train_step(groups())
    assert prepares == [True] and metrics["trainer/updates"] == 6
    per_pass = len(calls) // 3  # micro-batches per epoch
    first = calls[:per_pass]
    for logp, proximal in first[:len(first) // 2]:  # the first update (first mini-batch)
        assert torch.equal(logp, proximal)  # ratio exactly 1: nothing moved yet
    for epoch in (1, 2):  # later epochs: the very same proximal tensors, the current moved
        for (logp, proximal), (_, scored) in zip(calls[epoch * per_pass:], first):
            assert proximal is scored
            assert not torch.equal(logp, proximal)


def test_a_failing_multi_epoch_step_changes_nothing(model_dir, monkeypatch):
    """The snapshot covers every update of a step: a non-finite loss at the last update of the
    last epoch restores the weights, the optimizer state and the version."""
    learner = make_learner(model_dir, algorithm("ppo", ppo_epochs=2, mini_batches=2))
    learner.train_step(groups(5))  # optimizer state exists
    before = [p.detach().clone() for p in learner.params]
    version, real_loss, calls = learner.policy_version, update.compute_policy_loss, []

    def failing_last(*args, **kwargs):
        loss, metrics = real_loss(*args, **kwargs)
        calls.append(1)
        if len(calls) == 4:  # 2 epochs x 2 mini-batches x 1 micro-batch each: the last one
            loss = loss * float("nan")
            metrics["loss_sum"] = metrics["loss_sum"] * float("nan")
        return loss, metrics

    monkeypatch.setattr(update, "compute_policy_loss", failing_last)
    with pytest.raises(learner_module.StepError, match="non-finite"):
        learner.train_step(groups(6, n=2))
    assert learner.policy_version == version
    for param, saved in zip(learner.params, before):
        assert torch.equal(param.detach(), saved)


# -- finding 5: the actor's and the critic's gradients are clipped apart ---------------------

def clipped_actor_grads(model_dir, value_coef: float) -> tuple[dict, dict]:
    """The actor's gradients as the optimizer sees them (after clipping) in one PPO update."""
    learner = make_learner(model_dir, algorithm("ppo", ppo_epochs=1, value_coef=value_coef),
                           grad_clip=1.0)
    seen: dict[str, torch.Tensor] = {}
    real_step = learner.optimizer.step
    actor = {id(p) for p in learner.actor_params}

    def capture(*args, **kwargs):
        for name, p in learner.trained.named_parameters():
            if id(p) in actor and p.grad is not None:
                grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                seen[name] = grad.clone()
        return real_step(*args, **kwargs)

    learner.optimizer.step = capture
    metrics = learner.train_step(groups())
    distributed.destroy()
    return seen, metrics


def test_a_huge_critic_gradient_does_not_scale_the_actor_step(model_dir):
    small, small_metrics = clipped_actor_grads(model_dir, value_coef=0.5)
    huge, huge_metrics = clipped_actor_grads(model_dir, value_coef=1e4)
    assert huge_metrics["trainer/critic_grad_norm"] > 1e3 * huge_metrics["trainer/actor_grad_norm"]
    assert huge_metrics["trainer/actor_grad_norm"] == pytest.approx(
        small_metrics["trainer/actor_grad_norm"], rel=1e-6)
    assert small and small.keys() == huge.keys()
    for name, grad in small.items():  # one joint clip would scale the actor's by ~1e-4
        assert_close(huge[name], grad, rtol=1e-5, atol=1e-9, msg=name)


def test_the_critic_has_its_own_clip(model_dir):
    """critic_grad_clip bounds the critic's gradient norm and leaves the actor's alone."""
    learner = make_learner(model_dir, algorithm("ppo", ppo_epochs=1), grad_clip=1e9,
                           critic_grad_clip=1e-3)
    seen = []
    real_step = learner.optimizer.step

    def capture(*args, **kwargs):
        norm = lambda ps: float(torch.sqrt(sum((p.grad.full_tensor() if isinstance(  # noqa: E731
            p.grad, DTensor) else p.grad).square().sum() for p in ps if p.grad is not None)))
        seen.append((norm(learner.actor_params), norm(learner.critic_params)))
        return real_step(*args, **kwargs)

    learner.optimizer.step = capture
    metrics = learner.train_step(groups())
    ((actor, value),) = seen
    assert value == pytest.approx(1e-3, rel=1e-4)
    assert metrics["trainer/critic_grad_norm"] > 1e-2  # pre-clip: well above the cap
    assert actor == pytest.approx(metrics["trainer/actor_grad_norm"], rel=1e-5)


# -- finding 8: scoring runs in eval mode ---------------------------------------------------

def test_scoring_under_lora_dropout_is_deterministic(model_dir, monkeypatch):
    """LoRA dropout 0.5: two scorings of one batch agree exactly (proximal logprobs, old values
    and the public `score`), while training forwards still drop out."""
    learner = make_learner(model_dir, algorithm("ppo", ppo_epochs=2),
                           lora=LoraSettings(r=4, alpha=8, dropout=0.5))
    learner.train_step(groups(1))  # B != 0: the adapters now change the output; train mode
    batch = make_micro_batches(groups(2), max_tokens=10_000)[0]
    assert learner.trained.training
    assert torch.equal(learner.score(batch), learner.score(batch))
    assert learner.trained.training  # scoring restored the mode it found
    prepared = []
    real_prepare = learner_module.prepare

    def keep(*args, **kwargs):
        out = real_prepare(*args, **kwargs)
        prepared.append(out[0])
        return out

    monkeypatch.setattr(learner_module, "prepare", keep)
    for _ in range(2):
        learner.train_step(groups(2), apply=False)
    first, second = ([e for extras in p for e in extras] for p in prepared)
    for a, b in zip(first, second):
        assert torch.equal(a.proximal, b.proximal) and torch.equal(a.old_values, b.old_values)
    with torch.no_grad():  # a training forward drops out: two of them differ
        assert not torch.equal(learner.scorer.logprobs(batch), learner.scorer.logprobs(batch))


# -- finding 9: the reported loss is what was backpropagated ---------------------------------

def test_the_reported_loss_is_the_backpropagated_total_under_sequence_aggregation(
        model_dir, monkeypatch):
    """seq_mean_token_mean with a KL and an entropy term, 2 updates: trainer/loss is the mean over
    the updates of the summed micro-batch losses that were backpropagated, and its terms add up."""
    learner = make_learner(model_dir, algorithm(
        "grpo", mini_batches=2, loss={"aggregation": "seq_mean_token_mean", "kl_coef": 0.5,
                                      "entropy_coef": 0.1}), lr=5e-2)
    learner.train_step(groups(3))  # the actor moves off the reference: KL > 0
    backpropagated, real_loss = [], update.compute_policy_loss

    def record(*args, **kwargs):
        loss, metrics = real_loss(*args, **kwargs)
        backpropagated.append(float(loss))
        return loss, metrics

    monkeypatch.setattr(update, "compute_policy_loss", record)
    m = learner.train_step(groups(4))
    assert m["trainer/updates"] == 2
    assert m["trainer/loss"] == pytest.approx(sum(backpropagated) / 2, rel=1e-6, abs=1e-7)
    assert m["trainer/loss"] == pytest.approx(
        m["trainer/policy_loss"] + m["trainer/kl_loss"] + m["trainer/entropy_loss"], rel=1e-6)
    assert m["trainer/kl_loss"] > 0.0 > m["trainer/entropy_loss"]
    assert m["trainer/entropy_loss"] == pytest.approx(-0.1 * m["trainer/entropy"], rel=0.2)


def test_ppo_reports_the_value_term_and_the_explained_variance(model_dir):
    learner = make_learner(model_dir, algorithm("ppo", ppo_epochs=1))
    m = learner.train_step(groups())
    assert m["trainer/loss"] == pytest.approx(
        m["trainer/policy_loss"] + 0.5 * m["trainer/value_loss"], rel=1e-6)
    assert m["trainer/value_explained_var"] <= 1.0
    first = m["trainer/value_explained_var"]
    for _ in range(8):  # the critic fits the returns of a fixed batch
        m = learner.train_step(groups())
    assert m["trainer/value_explained_var"] > first


def test_ppo_epochs_is_validated():
    with pytest.raises(Exception, match="ppo_epochs must be >= 1, got 0"):
        replace(AlgorithmConfig(), ppo_epochs=0)
