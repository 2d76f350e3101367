"""Off-policy correction: importance weights of the proximal policy over the behaviour policy.

The behaviour policy sampled the tokens (logprobs recorded by the rollout engine); the proximal
policy is the trainer's view of the weights the trust region is built around. They differ by
staleness (asynchronous rollouts) and by engine/trainer numerics (kernels, precision). Decoupled
PPO (Hilton et al. 2021, "Batch size-invariance for policy optimization") multiplies the
objective by w = proximal / behaviour; as in AReaL (Fu et al. 2025) and "Your efficient RL
framework secretly brings you off-policy RL training" (Yao et al. 2025), w is either truncated
(TIS: min(w, upper), and max(., lower) when a lower bound is given) or masked (MIS: 0 outside
[lower, upper]), at one of three levels:
- `token`: w_t = exp(proximal_t - behaviour_t);
- `sequence`: exp(sum over the row's valid tokens of the log-ratio), the same for every token;
- `geometric`: exp(mean over the row's valid tokens of the log-ratio), the same for every token.

Simplifications:
- Weights are detached: they rescale the gradient, they are not optimised.
- Log-ratios (the per-row sum or mean for the row levels) are clamped to +-LOG_RATIO_CLAMP
  before `exp`; masked-out positions count as log-ratio 0 and get weight 0.
- Truncation's lower bound is optional (None: none, the usual TIS); masking drops a whole row at
  the row levels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from miles.errors import ConfigError
from miles.rl.kl import kl_estimate
from miles.rl.ratios import LOG_RATIO_CLAMP

IS_LEVELS = ("token", "sequence", "geometric")
"""Where behaviour importance ratios are formed (see the module docstring)."""

IS_MODES = ("truncate", "mask")
"""How out-of-range behaviour importance ratios are handled."""


@dataclass(frozen=True)
class BehaviourWeights:
    """Detached behaviour importance weights of one micro-batch, all [B, T]."""

    weight: torch.Tensor  # [B, T] float: the weight applied to each token's loss (0 if padded)
    truncated: torch.Tensor  # [B, T] bool: the raw ratio was outside [lower, upper] and clamped
    masked: torch.Tensor  # [B, T] bool: the raw ratio was outside [lower, upper], weight 0


def behaviour_weights(proximal_logp: torch.Tensor, behaviour_logp: torch.Tensor,
                      mask: torch.Tensor, *,
                      level: Literal["token", "sequence", "geometric"] = "token",
                      mode: Literal["truncate", "mask"] = "truncate", upper: float,
                      lower: float | None = None) -> BehaviourWeights:
    """Importance weights proximal / behaviour ([B, T] logprobs, `mask` [B, T] bool).

    truncate: w = clamp(ratio, lower, upper); mask: w = ratio inside [lower, upper], else 0 (no
    lower bound when `lower` is None). At the row levels one ratio per row decides for all its
    tokens.
    """
    if level not in IS_LEVELS or mode not in IS_MODES:
        raise ConfigError(f"behaviour weights: level must be one of {IS_LEVELS} and mode one of "
                          f"{IS_MODES}, got level={level!r}, mode={mode!r}")
    log_ratio = torch.where(mask, proximal_logp.detach() - behaviour_logp.detach(), 0.0)
    if level != "token":
        log_ratio = log_ratio.sum(dim=-1, keepdim=True)  # [B, 1]
        if level == "geometric":
            log_ratio = log_ratio / mask.sum(dim=-1, keepdim=True).clamp(min=1)
    ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp().expand_as(mask)  # [B, T]
    above = (ratio > upper) & mask  # [B, T]
    below = (ratio < lower) & mask if lower is not None else torch.zeros_like(mask)
    if mode == "truncate":
        weight = ratio.clamp(min=lower, max=upper)
        return BehaviourWeights(weight=torch.where(mask, weight, 0.0), truncated=above | below,
                                masked=torch.zeros_like(mask))
    dropped = above | below  # [B, T]
    return BehaviourWeights(weight=torch.where(mask & ~dropped, ratio, 0.0),
                            truncated=torch.zeros_like(mask), masked=dropped)


def logprob_mismatch(proximal_logp: torch.Tensor, behaviour_logp: torch.Tensor) -> torch.Tensor:
    """|behaviour - proximal| per token ([B, T]), detached: the engine/trainer logprob gap."""
    return (behaviour_logp.detach() - proximal_logp.detach()).abs()


def mismatch_kl(proximal_logp: torch.Tensor, behaviour_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(behaviour || proximal) on behaviour-sampled tokens ([B, T]),
    detached: r - log r - 1 with r = proximal / behaviour."""
    return kl_estimate(behaviour_logp.detach(), proximal_logp.detach(), kind="k3")
