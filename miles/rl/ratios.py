"""Importance ratios between two policies, and the guard that keeps them finite.

Every ratio in `miles.rl` (PPO's current/proximal, the behaviour correction proximal/behaviour,
the k3 KL estimate) is exp of a difference of logprobs. A token one policy finds near-impossible
gives a huge difference, so the log-ratio is clamped to +-LOG_RATIO_CLAMP before `exp`.

Simplification: one symmetric bound for every ratio; the clamp also cuts the gradient of the
few tokens beyond it, which is what we want for such outliers.
"""

from __future__ import annotations

import torch

LOG_RATIO_CLAMP = 20.0
"""|log ratio| bound before `exp`: e^20 ~ 4.9e8 is finite in fp32 and bf16, so a huge log-ratio
(a token the engine found near-impossible) gives a large but finite weight, never inf/nan."""


def clamped_log_ratio(log_numerator: torch.Tensor, log_denominator: torch.Tensor
                      ) -> torch.Tensor:
    """log_numerator - log_denominator, clamped to +-LOG_RATIO_CLAMP (any shape)."""
    return (log_numerator - log_denominator).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def clamped_ratio(log_numerator: torch.Tensor, log_denominator: torch.Tensor) -> torch.Tensor:
    """exp(log_numerator - log_denominator) with the log-ratio clamped to +-LOG_RATIO_CLAMP."""
    return clamped_log_ratio(log_numerator, log_denominator).exp()
