"""One micro-batch's share of an optimizer update: the actor's and the critic's losses.

`accumulate` backpropagates the policy loss (`compute_policy_loss` against the step's proximal
logprobs, `scoring.prepare`), then the critic's clipped value loss times `value_coef`, one graph
alive at a time, and returns the detached metrics (`reduction` sums them). The training forwards
run in train mode (dropout on); the proximal policy and old values were scored in eval mode.
"""

from __future__ import annotations

import torch

from miles.rl.aggregation import Normalisers, aggregate_token_mean
from miles.rl.algorithm import AlgorithmConfig
from miles.rl.kl import entropy_from_logits
from miles.rl.losses import LossSettings, clipped_value_loss, compute_policy_loss
from miles.trainer.batching import MicroBatch
from miles.trainer.scoring import Prepared, Scorer


def accumulate(scorer: Scorer, batch: MicroBatch, extra: Prepared, normalisers: Normalisers,
               algorithm: AlgorithmConfig, settings: LossSettings, *,
               train_actor: bool) -> dict[str, torch.Tensor]:
    """Backpropagate the actor's loss (unless `train_actor` is false: critic warm-up), then the
    critic's (with a critic); returns the detached metrics on the CPU. `settings`: the policy
    loss's (`KLPenalty.loss_settings`: no KL term when the KL is in the reward)."""
    mask = batch.response_mask.to(scorer.device)  # [B, L-1]
    metrics: dict[str, torch.Tensor] = {}
    if train_actor:
        loss, metrics = policy_loss(scorer, batch, extra, normalisers, mask, settings)
        loss.backward()
    if algorithm.uses_critic:
        loss, value_metrics = value_loss(scorer, batch, extra, normalisers, mask, algorithm)
        (algorithm.value_coef * loss).backward()
        metrics.update(value_metrics)
    return {key: value.cpu() for key, value in metrics.items()}


def policy_loss(scorer: Scorer, batch: MicroBatch, extra: Prepared, normalisers: Normalisers,
                mask: torch.Tensor, settings: LossSettings
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    processed = scorer.processed(scorer.forward(scorer.model, batch).logits, batch)
    logp = scorer.gather(processed, batch)  # [B, L-1]
    entropy = batch.unpack(entropy_from_logits(  # [B, L-1]
        processed if settings.entropy_coef else processed.detach()))  # 0: measured only
    proximal = extra.proximal if extra.proximal is not None else logp.detach()
    advantages = extra.advantages if extra.advantages is not None else \
        batch.advantages.to(scorer.device).unsqueeze(1)  # [B, L-1] or [B, 1]
    return compute_policy_loss(
        logp, proximal, batch.behaviour_logprobs.to(scorer.device), advantages, mask,
        normalisers=normalisers, settings=settings, ref_logp=extra.reference, entropy=entropy)


def value_loss(scorer: Scorer, batch: MicroBatch, extra: Prepared, normalisers: Normalisers,
               mask: torch.Tensor, algorithm: AlgorithmConfig
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The critic's PPO value loss (clipped around the step's old values), token mean."""
    new_values = scorer.values(batch)  # [B, L-1]
    per_token, clipped = clipped_value_loss(new_values, extra.old_values, extra.returns,
                                            clip=algorithm.value_clip)
    loss = aggregate_token_mean(per_token, mask, normalisers)

    def masked_sum(values: torch.Tensor) -> torch.Tensor:
        return torch.where(mask, values.detach().float(), 0.0).sum()

    return loss, {"value_tokens": mask.sum().float(),
                  "value_loss": loss.detach().float(),
                  "value_loss_sum": masked_sum(per_token),
                  "value_clipped": masked_sum(clipped),
                  "value_sum": masked_sum(new_values),
                  "return_sum": masked_sum(extra.returns)}
