"""The policy loss: an objective, behaviour correction, aggregation and regularisers, composed.

Three policies meet here: the behaviour policy that sampled the tokens (logprobs recorded by the
engine), the proximal policy (the trainer's weights before this update, logprobs recomputed
without grad) and the current policy (the weights being optimised). `compute_policy_loss`:
1. per-token objective terms of current vs proximal (`miles.rl.objectives`: ppo, gspo, cispo);
2. times the detached behaviour weight proximal / behaviour (`miles.rl.correction`: decoupled PPO,
   Hilton et al. 2021; truncated or masked, per token or per sequence);
3. aggregated with global normalisers (`miles.rl.aggregation`), so gradient accumulation over
   micro-batches and ranks is exact;
4. plus kl_coef * KL(current || reference) and minus entropy_coef * entropy, aggregated the same
   way (`miles.rl.kl`).
It returns detached metric sums alongside, and the three aggregated loss terms (`policy_loss`,
`kl_loss`, `entropy_loss`: what the loss adds up, with their coefficients and signs).
`clipped_value_loss` is the critic's loss (PPO).

Simplifications:
- Metrics are sums/counts over the valid tokens (plus maxes), so callers add them over
  micro-batches and ranks and divide once; `MAX_METRICS` names the ones to reduce with max.
- The KL and entropy terms are not importance-weighted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from miles.errors import ConfigError
from miles.rl.aggregation import AGGREGATIONS, Normalisers, get_aggregation, token_mean
from miles.rl.correction import (IS_LEVELS, IS_MODES, BehaviourWeights, behaviour_weights,
                                 logprob_mismatch, mismatch_kl)
from miles.rl.kl import KL_KINDS, k3_kl, kl_estimate
from miles.rl.objectives import OBJECTIVES, ObjectiveSettings, get_objective
from miles.rl.ratios import LOG_RATIO_CLAMP, clamped_ratio

__all__ = ["LOG_RATIO_CLAMP", "MAX_METRICS", "LossSettings", "clamped_ratio", "clipped_value_loss",
           "compute_policy_loss", "k3_kl", "token_mean"]

MAX_METRICS = frozenset({"is_weight_max"})
"""Keys of `compute_policy_loss` metrics to reduce with max (all others sum)."""


@dataclass(frozen=True, kw_only=True)
class LossSettings(ObjectiveSettings):
    """How the policy loss is built; the clip bounds are inherited from `ObjectiveSettings`."""

    objective: str = "ppo"  # per-token objective: ppo, gspo or cispo
    aggregation: str = "token_mean"  # token_mean, seq_mean_token_mean or seq_sum_constant
    is_level: Literal["token", "sequence", "geometric"] | None = None  # behaviour IS ratio
    # level; None: geometric under objective gspo (its own sequence ratio's level), else token
    is_mode: Literal["truncate", "mask"] = "truncate"  # clamp to the bounds, or zero outside
    is_upper: float = 2.0  # behaviour IS weight cap (truncate) or upper bound (mask)
    is_lower: float | None = None  # truncate: weight floor; mask: lower bound of kept ratios;
    # None: no lower bound
    kl_coef: float = 0.0  # weight of the KL to the reference (the loss term, or the reward
    # penalty under algorithm.kl_in_reward); the initial value under kl_target; 0: off
    kl_target: float | None = None  # adaptive KL (Ziegler et al. 2019): target KL per response
    # (nats, k1 summed over its tokens, batch mean); None: kl_coef stays fixed
    kl_horizon: float = 10000.0  # adaptive KL: samples over which the coefficient moves by
    # (1 + 0.2) at most: coef *= 1 + clip(kl / target - 1, +-0.2) * samples / horizon
    kl_kind: Literal["k1", "k2", "k3"] = "k3"  # per-token KL estimator (Schulman 2020)
    entropy_coef: float = 0.0  # weight of the entropy bonus (subtracted from the loss); 0: off

    def __post_init__(self) -> None:
        super().__post_init__()
        checks = [
            (self.objective in OBJECTIVES,
             f"objective must be one of {sorted(OBJECTIVES)}, got {self.objective!r}"),
            (self.aggregation in AGGREGATIONS,
             f"aggregation must be one of {sorted(AGGREGATIONS)}, got {self.aggregation!r}"),
            (self.is_level is None or self.is_level in IS_LEVELS,
             f"is_level must be one of {list(IS_LEVELS)} or None, got {self.is_level!r}"),
            (self.is_mode in IS_MODES,
             f"is_mode must be one of {list(IS_MODES)}, got {self.is_mode!r}"),
            (self.is_upper >= 1, f"is_upper must be >= 1, got {self.is_upper}"),
            (self.is_lower is None or 0 <= self.is_lower <= 1,
             f"is_lower must be in [0, 1] or None, got {self.is_lower}"),
            (self.kl_coef >= 0, f"kl_coef must be >= 0, got {self.kl_coef}"),
            (self.kl_target is None or self.kl_target > 0,
             f"kl_target must be > 0 or None, got {self.kl_target}"),
            (self.kl_target is None or self.kl_coef > 0, "kl_target needs kl_coef > 0 (the "
             f"controller's initial coefficient), got kl_coef={self.kl_coef}"),
            (self.kl_horizon > 0, f"kl_horizon must be > 0, got {self.kl_horizon}"),
            (self.kl_kind in KL_KINDS,
             f"kl_kind must be one of {list(KL_KINDS)}, got {self.kl_kind!r}"),
            (self.entropy_coef >= 0, f"entropy_coef must be >= 0, got {self.entropy_coef}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

    @property
    def behaviour_level(self) -> str:
        """The behaviour IS level used: `is_level`, or its default for the objective."""
        if self.is_level is not None:
            return self.is_level
        return "geometric" if self.objective == "gspo" else "token"


def compute_policy_loss(logp: torch.Tensor, proximal_logp: torch.Tensor,
                        behaviour_logp: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor, *, normalisers: Normalisers, settings: LossSettings,
                        ref_logp: torch.Tensor | None = None,
                        entropy: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Policy loss of one micro-batch (0-dim, differentiable) and its detached metric sums.

    `logp`, `proximal_logp`, `behaviour_logp`, `ref_logp`, `entropy` and `mask` (bool) are
    [B, T]; `advantages` [B, T] or [B, 1]. `ref_logp` is needed when kl_coef > 0 and `entropy`
    when entropy_coef > 0; given with a zero coefficient they are only measured. Metrics: see
    `loss_metrics`, plus the aggregated terms `policy_loss`, `kl_loss` (kl_coef * KL) and
    `entropy_loss` (-entropy_coef * entropy), which sum to the loss (like it, they add up over
    micro-batches and ranks: the normalisers are global).
    """
    if settings.kl_coef > 0 and ref_logp is None:
        raise ValueError("compute_policy_loss: kl_coef > 0 needs ref_logp")
    if settings.entropy_coef > 0 and entropy is None:
        raise ValueError("compute_policy_loss: entropy_coef > 0 needs entropy")
    terms = get_objective(settings.objective)(logp, proximal_logp, advantages, mask,
                                              settings=settings)
    weights = behaviour_weights(proximal_logp, behaviour_logp, mask,
                                level=settings.behaviour_level, mode=settings.is_mode,
                                upper=settings.is_upper, lower=settings.is_lower)
    aggregate = get_aggregation(settings.aggregation)
    token_loss = weights.weight * terms.loss  # [B, T]
    policy_loss = aggregate(token_loss, mask, normalisers)
    zero = torch.zeros((), device=policy_loss.device)
    kl = None if ref_logp is None else kl_estimate(logp, ref_logp.detach(), settings.kl_kind)
    kl_loss = settings.kl_coef * aggregate(kl, mask, normalisers) if settings.kl_coef > 0 \
        else zero
    entropy_loss = -settings.entropy_coef * aggregate(entropy, mask, normalisers) \
        if settings.entropy_coef > 0 else zero
    loss = policy_loss + kl_loss + entropy_loss
    metrics = loss_metrics(logp, proximal_logp, behaviour_logp, mask, token_loss=token_loss,
                           clipped=terms.clipped, ratio=terms.ratio, weights=weights, kl=kl,
                           entropy=entropy)
    metrics.update({"policy_loss": policy_loss.detach().float(),
                    "kl_loss": kl_loss.detach().float(),
                    "entropy_loss": entropy_loss.detach().float()})
    return loss, metrics


def loss_metrics(logp: torch.Tensor, proximal_logp: torch.Tensor, behaviour_logp: torch.Tensor,
                 mask: torch.Tensor, *, token_loss: torch.Tensor, clipped: torch.Tensor,
                 ratio: torch.Tensor, weights: BehaviourWeights, kl: torch.Tensor | None,
                 entropy: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Detached 0-dim metric sums over the `mask`ed tokens ([B, T] inputs).

    `tokens`, `loss_sum` (weighted per-token loss), `clipped` (split into `clipped_low`, ratio
    below 1, and `clipped_high`, ratio above 1), `kl_proximal_sum` (k3 KL(proximal || current),
    PPO's approx-KL), `is_weight_sum`, `is_weight_max`
    (max), `is_truncated`, `is_masked`, `kl_behaviour_sum` (k3 KL(behaviour || current)),
    `kl_mismatch_sum` (k3 KL(behaviour || proximal)), `mismatch_sum` (|behaviour - proximal|),
    and, when given, `kl_ref_sum` (the configured KL estimate) and `entropy_sum`. Divide the sums
    by the summed `tokens`.
    """
    def masked_sum(values: torch.Tensor) -> torch.Tensor:
        return torch.where(mask, values.detach().float(), 0.0).sum()

    metrics = {
        "tokens": mask.sum().float(),
        "loss_sum": masked_sum(token_loss),
        "clipped": masked_sum(clipped),
        "clipped_low": masked_sum(clipped & (ratio.detach() < 1.0)),
        "clipped_high": masked_sum(clipped & (ratio.detach() > 1.0)),
        "kl_proximal_sum": masked_sum(k3_kl(logp.detach(), proximal_logp)),
        "is_weight_sum": masked_sum(weights.weight),
        "is_weight_max": torch.where(mask, weights.weight, 0.0).max() if mask.numel()
        else torch.zeros(()),
        "is_truncated": masked_sum(weights.truncated),
        "is_masked": masked_sum(weights.masked),
        "kl_behaviour_sum": masked_sum(k3_kl(logp.detach(), behaviour_logp)),
        "kl_mismatch_sum": masked_sum(mismatch_kl(proximal_logp, behaviour_logp)),
        "mismatch_sum": masked_sum(logprob_mismatch(proximal_logp, behaviour_logp)),
    }
    if kl is not None:
        metrics["kl_ref_sum"] = masked_sum(kl)
    if entropy is not None:
        metrics["entropy_sum"] = masked_sum(entropy)
    return metrics


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, *,
                       clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO value loss and whether its clipped branch is active, both [B, T].

    0.5 * max((V - R)^2, (V_old + clamp(V - V_old, -clip, clip) - R)^2), the value clipping
    of the PPO reference implementations; `clip` 0 disables it (plain 0.5 * (V - R)^2).
    """
    unclipped = (values - returns) ** 2  # [B, T]
    if clip <= 0:
        return 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)  # [B, T]
    clipped = (clipped_values - returns) ** 2  # [B, T]
    return 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped).detach()
