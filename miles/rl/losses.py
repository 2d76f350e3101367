"""Policy-gradient losses: decoupled PPO-clip with truncated behaviour importance weights.

Three policies meet here (see docs of `decoupled_ppo_clip`): the behaviour policy that sampled
the tokens (logprobs recorded by the engine), the proximal policy (the trainer's weights before
this update, logprobs recomputed without grad) and the current policy (the weights being
optimised). The trust region is around the proximal policy; staleness and engine/trainer numeric
mismatch are corrected by the behaviour importance weight proximal/behaviour, truncated at
`is_cap` (decoupled PPO, Hilton et al. 2021; truncated IS as in AReaL/slime).

The objective (per-token terms) and the aggregation (token-mean over a given normaliser) are
separate functions; `policy_loss` composes them and adds detached metric sums.

Simplifications:
- Token-mean aggregation only; the normaliser is passed in (the response-token count of the
  global batch, across micro-batches and ranks), so gradient accumulation is exact.
- No KL penalty against a reference policy and no entropy bonus yet.
- Metrics are sums/counts (plus one max), so callers add them over micro-batches and ranks and
  divide once; `MAX_METRICS` names the ones to reduce with max instead of sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOG_RATIO_CLAMP = 20.0
"""|log ratio| bound before `exp`: e^20 ~ 4.9e8 is finite in fp32 and bf16, so a huge log-ratio
(a token the engine found near-impossible) gives a large but finite weight, never inf/nan."""

MAX_METRICS = frozenset({"is_weight_max"})
"""Keys of `policy_loss` metrics to reduce with max (all others are sums)."""


@dataclass(frozen=True)
class PolicyTerms:
    """Per-token terms of the decoupled PPO-clip objective, all [B, T]."""

    loss: torch.Tensor  # [B, T] is_weight * pg, differentiable w.r.t. the current logprobs
    ratio: torch.Tensor  # [B, T] current / proximal (log-ratio clamped), differentiable
    is_weight: torch.Tensor  # [B, T] min(proximal / behaviour, is_cap), detached
    clipped: torch.Tensor  # [B, T] bool: the clipped branch of the min is active
    truncated: torch.Tensor  # [B, T] bool: the raw importance weight exceeded is_cap


def clamped_ratio(log_numerator: torch.Tensor, log_denominator: torch.Tensor) -> torch.Tensor:
    """exp(log_numerator - log_denominator) with the log-ratio clamped to +-LOG_RATIO_CLAMP."""
    log_ratio = (log_numerator - log_denominator).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return log_ratio.exp()


def decoupled_ppo_clip(logp: torch.Tensor, proximal_logp: torch.Tensor,
                       behaviour_logp: torch.Tensor, advantages: torch.Tensor, *,
                       clip_low: float, clip_high: float, is_cap: float) -> PolicyTerms:
    """Per-token decoupled PPO-clip terms.

    ratio = exp(clamp(logp - proximal)), pg = -min(ratio * A, clip(ratio, 1 - clip_low,
    1 + clip_high) * A), w = min(exp(clamp(proximal - behaviour)), is_cap) (no grad),
    loss = w * pg. `logp`, `proximal_logp`, `behaviour_logp` are [B, T]; `advantages` is [B, T]
    or broadcastable to it ([B, 1]).
    """
    ratio = clamped_ratio(logp, proximal_logp.detach())  # [B, T]
    unclipped = -ratio * advantages  # [B, T]
    clipped = -ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages  # [B, T]
    pg = torch.maximum(unclipped, clipped)  # [B, T] = -min(ratio * A, clip(ratio) * A)
    raw_weight = clamped_ratio(proximal_logp, behaviour_logp).detach()  # [B, T]
    is_weight = raw_weight.clamp(max=is_cap)  # [B, T]
    return PolicyTerms(loss=is_weight * pg, ratio=ratio, is_weight=is_weight,
                       clipped=(clipped > unclipped).detach(), truncated=raw_weight > is_cap)


def token_mean(values: torch.Tensor, mask: torch.Tensor, normaliser: float | torch.Tensor
               ) -> torch.Tensor:
    """Sum of `values` ([B, T]) where `mask` ([B, T] bool) is set, divided by `normaliser`.

    With `normaliser` = the token count of the global batch, summing this over micro-batches and
    ranks gives the token mean of the whole batch. Masked-out entries may hold inf/nan.
    """
    return torch.where(mask, values, 0.0).sum() / normaliser


def k3_kl(logp: torch.Tensor, behaviour_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(behaviour || current) on behaviour-sampled tokens ([B, T]).

    With r = p_current / p_behaviour: r - log r - 1 (>= 0, unbiased, low variance; Schulman 2020).
    """
    log_ratio = (logp - behaviour_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [B, T]
    return log_ratio.exp() - log_ratio - 1.0


def policy_loss(logp: torch.Tensor, proximal_logp: torch.Tensor, behaviour_logp: torch.Tensor,
                advantages: torch.Tensor, mask: torch.Tensor, *,
                normaliser: float | torch.Tensor, clip_low: float, clip_high: float,
                is_cap: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-mean decoupled PPO-clip loss of one micro-batch, and detached metric sums.

    Metrics (0-dim tensors, over the `mask`ed tokens of this micro-batch): `tokens`, `loss_sum`,
    `clipped`, `is_weight_sum`, `is_weight_max`, `is_truncated`, `kl_behaviour_sum`,
    `mismatch_sum` (|behaviour - proximal|). Divide the sums by the summed `tokens`.
    """
    terms = decoupled_ppo_clip(logp, proximal_logp, behaviour_logp, advantages,
                               clip_low=clip_low, clip_high=clip_high, is_cap=is_cap)
    loss = token_mean(terms.loss, mask, normaliser)

    def masked_sum(values: torch.Tensor) -> torch.Tensor:
        return torch.where(mask, values.detach().float(), 0.0).sum()

    metrics = {
        "tokens": mask.sum().float(),
        "loss_sum": masked_sum(terms.loss),
        "clipped": masked_sum(terms.clipped),
        "is_weight_sum": masked_sum(terms.is_weight),
        "is_weight_max": torch.where(mask, terms.is_weight, 0.0).max() if mask.numel()
        else torch.zeros(()),
        "is_truncated": masked_sum(terms.truncated),
        "kl_behaviour_sum": masked_sum(k3_kl(logp.detach(), behaviour_logp)),
        "mismatch_sum": masked_sum((behaviour_logp - proximal_logp).abs()),
    }
    return loss, metrics
