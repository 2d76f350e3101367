"""Under `kl_in_reward` the KL to the reference is in the reward only: the loss that is
backpropagated has no KL term (issue 15, finding 2: the k3 loss term was added on top).

The check, through the real Learner on the tiny model and only its config surface
(`AlgorithmConfig`, `LossSettings`, `LearnerConfig`): the behaviour logprobs are the reference's
own (scored while LoRA is the identity), so the KL penalty in the reward, kl_coef x
(behaviour - reference), is zero; then every LoRA B is set away from zero, so the current policy
is not the reference and a KL loss term, kl_coef x k3(current, reference), would have a
gradient (k3's is (1 - e^(ref - logp)) d logp per token). The gradient of a step with
`kl_in_reward` and kl_coef = 1 must then equal that of the same batch with no KL at all.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.distributed.tensor import DTensor

from miles.rl.algorithm import AlgorithmConfig
from miles.rl.losses import LossSettings
from miles.trainer import distributed
from miles.trainer.learner import Learner, LearnerConfig
from miles.trainer.model import LoraSettings
from tests.factories import make_group

VOCAB = 78  # the tiny character tokenizer
LORA = LoraSettings(r=4, alpha=8, dropout=0.0)
KL_COEF = 1.0
B_SCALE = 0.3  # the LoRA B weights' scale: current vs reference logprobs differ by ~0.1 nats
MOVED = 0.02  # the smallest mean |current - reference| per token that makes the check bite


@pytest.fixture(scope="module", autouse=True)
def process_group():
    yield
    distributed.destroy()


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def learner_for(model_dir, estimator: str, *, kl_in_reward: bool) -> Learner:
    loss = LossSettings(kl_coef=KL_COEF if kl_in_reward else 0.0)
    algorithm = AlgorithmConfig(estimator=estimator, kl_in_reward=kl_in_reward, loss=loss)
    config = LearnerConfig(lr=1e-3, grad_clip=1e9, seed=0, algorithm=algorithm)
    return Learner(model_dir, config, lora=LORA)


def groups(logprobs: dict | None = None) -> list:
    """Two groups of four samples of 4 tokens; behaviour logprobs `logprobs` by sample id."""
    out = []
    for g in range(2):
        group = make_group(n_samples=4, n_tokens=4, prompt_tokens=3, vocab_size=VOCAB, seed=g,
                           policy_version=0)
        if logprobs is not None:
            group.samples[:] = [s.__class__(**{**s.__dict__, "logprobs": logprobs[(
                group.group_id, i)]}) for i, s in enumerate(group.samples)]
        out.append(group)
    return out


@torch.no_grad()
def scored(learner: Learner, batch_groups: list) -> dict:
    """The learner's logprobs of each sample's response tokens, by sample id."""
    out = {}
    for batch in learner.micro_batches(batch_groups):
        logp = learner.score(batch).cpu()  # [B, L-1]
        for row, sample_id in enumerate(batch.sample_ids):
            out[sample_id] = logp[row][batch.response_mask[row]].numpy().astype(np.float32)
    return out


@torch.no_grad()
def move_off_the_reference(learner: Learner) -> None:
    """Every LoRA B weight set from a fixed generator (the same in every learner)."""
    generator = torch.Generator().manual_seed(1)
    for name, param in sorted(learner.trained.named_parameters()):
        if "lora_B" in name:
            shard = local(param)
            shard.copy_(B_SCALE * torch.randn(shard.shape, generator=generator))


def step_gradients(learner: Learner, batch_groups: list) -> dict[str, torch.Tensor]:
    """The gradient of every trained weight at the (single) optimizer update of a step."""
    grads, step = {}, learner.optimizer.step

    def recording(*args, **kwargs):
        grads.update({n: local(p.grad).detach().clone()
                      for n, p in learner.trained.named_parameters() if p.grad is not None})
        return step(*args, **kwargs)

    learner.optimizer.step = recording
    learner.train_step(batch_groups)
    assert grads, "no optimizer update"
    return grads


@pytest.mark.parametrize("estimator", ["gae", "rloo"])
def test_kl_in_the_reward_leaves_no_kl_term_in_the_loss(model_dir, estimator):
    in_reward = learner_for(model_dir, estimator, kl_in_reward=True)
    reference = scored(in_reward, groups())  # LoRA is the identity: these are the reference's
    batch = groups(reference)
    move_off_the_reference(in_reward)
    moved = scored(in_reward, batch)
    gap = np.mean([np.abs(moved[k] - reference[k]).mean() for k in reference])
    assert gap > MOVED, f"the policy is still the reference ({gap:.4f} nats): a KL term is 0"
    plain = learner_for(model_dir, estimator, kl_in_reward=False)
    move_off_the_reference(plain)
    with_kl, without = step_gradients(in_reward, batch), step_gradients(plain, batch)
    assert with_kl.keys() == without.keys()
    for name in with_kl:
        torch.testing.assert_close(with_kl[name], without[name], rtol=1e-4, atol=1e-7,
                                   msg=lambda m, name=name: f"{name}: {m}")
