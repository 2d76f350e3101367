"""The learner's forwards, and the no-grad passes a step makes before its first update.

`Scorer` runs the sharded models on a `MicroBatch`: the policy's logprobs of the sampled targets
(under the batch's sampling settings), the reference's, and the critic's values. `prepare` scores,
once per step and before any optimizer update, what every update of the step needs: proximal
logprobs (when the step makes several updates), reference logprobs (KL term), the critic's old
values and the GAE advantages and returns computed from them (whitened over the global batch),
plus the critic's explained variance. Every update then sees the same proximal policy and old
values, so decoupled PPO's three policies (behaviour from the wire, proximal, current) stay exact
over `ppo_epochs` x `mini_batches` updates.

The no-grad passes run with the models in eval mode (`evaluating`): dropout (e.g. LoRA dropout)
would otherwise make proximal logprobs and old values noisy; two scorings of one batch agree
exactly. Training forwards run in train mode.

Simplifications:
- With one update per step the proximal policy *is* the current one: its logprobs are the
  detached training logprobs (no extra forward), so the ratio is exactly 1 and no clip fires (the
  GRPO paper's mu = 1). Under dropout these are the training forward's (train-mode) logprobs.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from miles.rl.advantages import gae_advantages, token_rewards
from miles.rl.algorithm import AlgorithmConfig
from miles.rl.kl import kl_estimate
from miles.rl.sampling import process_logits
from miles.trainer import critic, distributed
from miles.trainer.batching import MicroBatch
from miles.trainer.kl_penalty import KLPenalty

LOGPROB_FLOOR = -100.0
"""Trainer logprobs are floored here: a sampled token the trainer's top-k/top-p filter removes
(logprob -inf, engine/trainer mismatch at the filter edge) gets a tiny importance weight and no
gradient instead of a nan from -inf - -inf."""
WHITEN_EPS = 1e-8  # added to the std when whitening GAE advantages
VARIANCE_FLOOR = 1e-12  # explained variance is 0 when the returns' variance is below this


@dataclass
class Prepared:
    """What one micro-batch's updates need, scored before any update of the step ([B, L-1])."""

    proximal: torch.Tensor | None = None  # proximal logprobs (None: the detached current ones)
    reference: torch.Tensor | None = None  # reference logprobs (KL term)
    old_values: torch.Tensor | None = None  # critic values before the update
    advantages: torch.Tensor | None = None  # per-token GAE advantages (whitened)
    returns: torch.Tensor | None = None  # GAE returns (value targets)


@contextmanager
def evaluating(*modules: torch.nn.Module | None) -> Iterator[None]:
    """`modules` in eval mode inside (no dropout), each back in its previous mode on exit."""
    present = [m for m in modules if m is not None]
    modes = [m.training for m in present]
    for module in present:
        module.eval()
    try:
        yield
    finally:
        for module, mode in zip(present, modes):
            module.train(mode)


class Scorer:
    """Forwards of the policy (`model`), its reference and its critic on micro-batches. Each is a
    collective of the sharded model: every rank must make the same calls."""

    def __init__(self, model: torch.nn.Module, *, device: torch.device,
                 dtype: torch.dtype = torch.float32, reference: torch.nn.Module | None = None,
                 value_model: torch.nn.Module | None = None):
        self.model = model  # the policy (under LoRA also the reference and the critic)
        self.device = device
        self.dtype = dtype  # the models' compute dtype
        self.reference = reference  # full fine-tuning's frozen copy; None: disabled adapters
        self.value_model = value_model  # full fine-tuning's critic; None: the critic adapter

    def inputs(self, batch: MicroBatch) -> tuple:
        """(input_ids, attention_mask or None, position_ids) of `batch` on this rank's device."""
        mask = batch.attention_mask
        return (batch.input_ids.to(self.device), None if mask is None else mask.to(self.device),
                batch.position_ids.to(self.device))

    def forward(self, model: torch.nn.Module, batch: MicroBatch):
        input_ids, attention_mask, position_ids = self.inputs(batch)
        return model(input_ids=input_ids, attention_mask=attention_mask,
                     position_ids=position_ids, use_cache=False)

    def processed(self, logits: torch.Tensor, batch: MicroBatch) -> torch.Tensor:
        """Logits of the distribution each target was sampled from, [R, T-1, V] (model
        layout: `batch.unpack` turns per-prediction values into per-sample rows)."""
        s = batch.sampling
        return process_logits(logits[:, :-1].float(), temperature=s.temperature, top_k=s.top_k,
                              top_p=s.top_p)  # fp32 even when the model computes in bf16

    def gather(self, processed: torch.Tensor, batch: MicroBatch) -> torch.Tensor:
        """Floored logprobs of the targets under `processed` logits, [B, L-1]."""
        if batch.sample_targets is not None:  # shared prompts: index each sample's prediction
            logp = processed.log_softmax(dim=-1).flatten(0, 1)  # [R * (T-1), V]
            logp = logp[batch.layout.to(self.device), batch.sample_targets.to(self.device)]
            return logp.clamp(min=LOGPROB_FLOOR)  # [B, L-1]
        logp = processed.log_softmax(dim=-1).gather(
            -1, batch.targets.to(self.device).unsqueeze(-1)).squeeze(-1)  # [R, T-1]
        return batch.unpack(logp.clamp(min=LOGPROB_FLOOR))

    def logprobs(self, batch: MicroBatch) -> torch.Tensor:
        """Policy logprobs of the targets (floored), [B, L-1], in the model's current mode."""
        return self.gather(self.processed(self.forward(self.model, batch).logits, batch), batch)

    @torch.no_grad()
    def reference_logprobs(self, batch: MicroBatch) -> torch.Tensor:
        if self.reference is not None:
            logits = self.forward(self.reference, batch).logits
        else:
            with critic.disabled_adapters(self.model):
                logits = self.forward(self.model, batch).logits
        return self.gather(self.processed(logits, batch), batch)

    def values(self, batch: MicroBatch) -> torch.Tensor:
        """Critic values of the states that predict each target, [B, L-1]."""
        if self.value_model is not None:
            values = self.value_model(*self.inputs(batch))  # [R, T]
        else:
            values = critic.values(self.model, *self.inputs(batch))  # [R, T]
        return batch.unpack(values[:, :-1].float())


@torch.no_grad()
def prepare(scorer: Scorer, slices: list[list[MicroBatch]], algorithm: AlgorithmConfig,
            kl: KLPenalty, *, proximal: bool) -> tuple[list[list[Prepared]], dict[str, float]]:
    """Everything the step's updates need, scored in eval mode before the first update (see the
    module docstring); `proximal`: score proximal logprobs (the step makes several updates);
    `kl` puts the KL penalty into the rewards under `kl_in_reward` (`miles.trainer.kl_penalty`).
    Returns the per-micro-batch extras and critic metrics (empty without a critic)."""
    a = algorithm
    if not (proximal or a.uses_reference or a.uses_critic):  # nothing to score: no mode switch
        return [[Prepared() for _ in batches] for batches in slices], {}
    out = []
    with evaluating(scorer.model, scorer.reference, scorer.value_model):
        for batches in slices:
            extras = []
            for batch in batches:
                extra = Prepared()
                if proximal:
                    extra.proximal = scorer.logprobs(batch)
                if a.uses_reference:
                    extra.reference = scorer.reference_logprobs(batch)
                if a.uses_critic:
                    prepare_gae(scorer, batch, extra, a, kl.coef)
                extras.append(extra)
            out.append(extras)
    flat = [e for extras in out for e in extras]
    kl.prepare([b for batches in slices for b in batches], flat)
    if not a.uses_critic:
        return out, {}
    masks = [b.response_mask.to(scorer.device) for batches in slices for b in batches]
    return out, whiten(flat, masks)


def prepare_gae(scorer: Scorer, batch: MicroBatch, extra: Prepared,
                a: AlgorithmConfig, kl_coef: float) -> None:
    """The critic's old values of `batch` and its raw GAE advantages and returns, into `extra`.
    GAE's rewards: the sample's `token_rewards` at its policy tokens, the rest of its (shaped)
    `reward` on its last policy token, minus the KL penalty under `kl_in_reward`."""
    mask = batch.response_mask.to(scorer.device)  # [B, L-1]
    extra.old_values = scorer.values(batch)  # [B, L-1]
    penalty = None
    if a.kl_in_reward:  # InstructGPT: k1 KL of the sampling policy to the reference
        penalty = kl_estimate(batch.behaviour_logprobs.to(scorer.device), extra.reference, "k1")
    steps = None if batch.token_rewards is None else batch.token_rewards.to(scorer.device)
    rewards = token_rewards(batch.rewards.to(scorer.device), mask, penalty, kl_coef,
                            steps=steps)  # [B, L-1]: per-turn rewards, the rest at the end
    extra.advantages, extra.returns = gae_advantages(rewards, extra.old_values, mask,
                                                     gamma=a.gamma, lam=a.lam)


def whiten(extras: list[Prepared], masks: list[torch.Tensor]) -> dict[str, float]:
    """Normalise the GAE advantages by their mean and std over the global batch (population
    std); returns the critic's explained variance over the batch,
    1 - Var(returns - old values) / Var(returns) (0 when the returns do not vary)."""
    stats = torch.zeros(7, dtype=torch.float64)
    for extra, mask in zip(extras, masks):
        adv, ret = extra.advantages[mask].double(), extra.returns[mask].double()
        err = ret - extra.old_values[mask].double()
        stats += torch.stack([adv.sum(), (adv ** 2).sum(), ret.sum(), (ret ** 2).sum(),
                              err.sum(), (err ** 2).sum(),
                              torch.tensor(float(adv.numel()), dtype=torch.float64)]).cpu()
    adv_sum, adv_sq, ret_sum, ret_sq, err_sum, err_sq, count = \
        distributed.all_reduce_sum(stats).tolist()
    count = max(count, 1.0)

    def variance(total: float, squares: float) -> float:
        return max(squares / count - (total / count) ** 2, 0.0)

    mean, std = adv_sum / count, math.sqrt(variance(adv_sum, adv_sq))
    for extra, mask in zip(extras, masks):
        extra.advantages = torch.where(mask, (extra.advantages - mean) / (std + WHITEN_EPS), 0.0)
    returns_var = variance(ret_sum, ret_sq)
    explained = 0.0 if returns_var < VARIANCE_FLOOR else \
        1.0 - variance(err_sum, err_sq) / returns_var
    return {"trainer/value_explained_var": explained}
