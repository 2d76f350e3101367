"""Policy objectives: per-token loss terms of the current policy against the proximal policy.

Each objective is `objective(logp, proximal_logp, advantages, mask, *, settings)` with `logp`
the current logprobs (differentiable), `proximal_logp` those of the policy that defines the trust
region (treated as constants), all [B, T], `advantages` [B, T] or [B, 1]; it returns
`ObjectiveTerms`, per-token losses to be weighted (behaviour correction, `miles.rl.correction`)
and aggregated (`miles.rl.aggregation`) elsewhere. `OBJECTIVES` maps config names to them:
- `ppo`: PPO-clip (Schulman et al. 2017) with asymmetric bounds [1 - clip_low, 1 + clip_high]
  (clip-higher, DAPO, Yu et al. 2025) and optional dual clip (Ye et al. 2020, "Mastering complex
  control in MOBA games with deep reinforcement learning"): for A < 0 the loss is capped at
  -dual_clip * A, so one very large ratio cannot dominate.
- `gspo`: GSPO (Zheng et al. 2025, "Group sequence policy optimization"), in its GSPO-token form:
  s_i,t = sg(s_i) * exp(logp_t - sg(logp_t)) with s_i = exp(mean over the row's valid tokens of
  (logp - proximal_logp)). Its value is s_i on every token and d s_i,t / d logp_t = s_i, so with
  a per-sequence advantage and `seq_mean_token_mean` aggregation the value and gradient equal the
  sequence-level GSPO objective. Clipped per sequence with its own (much tighter) bounds.
- `cispo`: CISPO (MiniMax 2025, "MiniMax-M1", Section 3.1): -sg(clip(ratio, 1 - eps_low,
  1 + eps_high)) * A * logp with its own bounds `cispo_eps_low` / `cispo_eps_high`, either of
  them None for "no bound" (the paper sets no lower bound and tunes only eps_high). Every token
  keeps a gradient (through logp only); clipping bounds its weight.

Simplifications:
- `ratio` in the terms is for metrics; for `cispo` it is detached (its gradient is not used).
- CISPO's loss value is the REINFORCE surrogate (-w A logp), not comparable to PPO's -ratio A.
- Masked-out inputs are replaced by 0 before any arithmetic, so they may hold inf/nan; masked-out
  positions get loss 0, gradient 0 and `clipped` False.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from miles.config import choose
from miles.errors import ConfigError
from miles.rl.ratios import LOG_RATIO_CLAMP, clamped_ratio


@dataclass(frozen=True, kw_only=True)
class ObjectiveSettings:
    """Clip bounds of the policy objectives; each objective reads the fields it needs."""

    clip_low: float = 0.2  # ppo: lower ratio bound 1 - clip_low
    clip_high: float = 0.28  # ppo: upper ratio bound 1 + clip_high (clip-higher, DAPO)
    dual_clip: float | None = None  # ppo: cap of the A < 0 loss at -dual_clip * A (> 1); None: off
    seq_clip_low: float = 3e-4  # gspo: lower sequence-ratio bound 1 - seq_clip_low
    seq_clip_high: float = 4e-4  # gspo: upper sequence-ratio bound 1 + seq_clip_high
    cispo_eps_low: float | None = None  # cispo: IS weight floor 1 - eps_low; None: no floor
    cispo_eps_high: float | None = 1.0  # cispo: IS weight cap 1 + eps_high; None: no cap

    def __post_init__(self) -> None:
        checks = [
            (0 <= self.clip_low <= 1, f"clip_low must be in [0, 1], got {self.clip_low}"),
            (self.clip_high >= self.clip_low,  # ppo's clip-higher; cispo has its own bounds
             f"clip_high must be >= clip_low ({self.clip_low}), got {self.clip_high}"),
            (self.dual_clip is None or self.dual_clip > 1,
             f"dual_clip must be > 1 or None, got {self.dual_clip}"),
            (0 <= self.seq_clip_low <= 1,
             f"seq_clip_low must be in [0, 1], got {self.seq_clip_low}"),
            (self.seq_clip_high >= 0,
             f"seq_clip_high must be >= 0, got {self.seq_clip_high}"),
            (self.cispo_eps_low is None or 0 <= self.cispo_eps_low <= 1,
             f"cispo_eps_low must be in [0, 1] or None (no floor), got {self.cispo_eps_low}"),
            (self.cispo_eps_high is None or self.cispo_eps_high >= 0,
             f"cispo_eps_high must be >= 0 or None (no cap), got {self.cispo_eps_high}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)


@dataclass(frozen=True)
class ObjectiveTerms:
    """Per-token terms of a policy objective, all [B, T]."""

    loss: torch.Tensor  # [B, T] per-token loss, differentiable w.r.t. the current logprobs
    ratio: torch.Tensor  # [B, T] the ratio the objective clips (current / proximal)
    clipped: torch.Tensor  # [B, T] bool: a clip bound is active on the token


def ppo_clip(logp: torch.Tensor, proximal_logp: torch.Tensor, advantages: torch.Tensor,
             mask: torch.Tensor, *, settings: ObjectiveSettings) -> ObjectiveTerms:
    """PPO-clip: -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A), r = exp(logp - proximal).

    With `dual_clip` = c, tokens with A < 0 have the loss capped at -c A (no gradient there).
    `clipped`: the clipped branch (or the dual-clip cap) is active.
    """
    logp, proximal_logp = _masked(logp, mask), _masked(proximal_logp.detach(), mask)
    ratio = clamped_ratio(logp, proximal_logp)  # [B, T]
    unclipped = -ratio * advantages  # [B, T]
    clipped = -ratio.clamp(1.0 - settings.clip_low, 1.0 + settings.clip_high) * advantages
    loss = torch.maximum(unclipped, clipped)  # [B, T] = -min(r A, clip(r) A)
    is_clipped = clipped > unclipped  # [B, T]
    if settings.dual_clip is not None:
        cap = -settings.dual_clip * advantages  # [B, T] or [B, 1]
        capped = (advantages < 0) & (loss > cap)  # [B, T]
        loss = torch.where(capped, cap, loss)
        is_clipped = is_clipped | capped
    return ObjectiveTerms(loss=_masked(loss, mask), ratio=ratio, clipped=is_clipped & mask)


def gspo(logp: torch.Tensor, proximal_logp: torch.Tensor, advantages: torch.Tensor,
         mask: torch.Tensor, *, settings: ObjectiveSettings) -> ObjectiveTerms:
    """GSPO-token: -min(s A, clip(s, 1 - seq_clip_low, 1 + seq_clip_high) A) per token with
    s_i,t = sg(s_i) * exp(logp_t - sg(logp_t)), s_i the geometric-mean ratio of row i.

    The sequence log-ratio is clamped to +-LOG_RATIO_CLAMP; an empty row has s = 1.
    """
    logp, proximal_logp = _masked(logp, mask), _masked(proximal_logp.detach(), mask)
    count = mask.sum(dim=-1, keepdim=True).clamp(min=1)  # [B, 1]
    seq_log_ratio = (logp.detach() - proximal_logp).sum(dim=-1, keepdim=True) / count  # [B, 1]
    seq_log_ratio = seq_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = (seq_log_ratio + logp - logp.detach()).exp()  # [B, T], value s_i
    unclipped = -ratio * advantages  # [B, T]
    low, high = 1.0 - settings.seq_clip_low, 1.0 + settings.seq_clip_high
    clipped = -ratio.clamp(low, high) * advantages  # [B, T]
    loss = torch.maximum(unclipped, clipped)  # [B, T]
    return ObjectiveTerms(loss=_masked(loss, mask), ratio=ratio,
                          clipped=(clipped > unclipped) & mask)


def cispo(logp: torch.Tensor, proximal_logp: torch.Tensor, advantages: torch.Tensor,
          mask: torch.Tensor, *, settings: ObjectiveSettings) -> ObjectiveTerms:
    """CISPO: -sg(clip(r, 1 - cispo_eps_low, 1 + cispo_eps_high)) * A * logp, r = exp(logp -
    proximal); a bound that is None is not applied.

    The gradient flows through `logp` only. `clipped`: r lies outside the bounds.
    """
    logp, proximal_logp = _masked(logp, mask), _masked(proximal_logp.detach(), mask)
    ratio = clamped_ratio(logp.detach(), proximal_logp)  # [B, T]
    low, high = settings.cispo_eps_low, settings.cispo_eps_high
    weight = ratio if low is None and high is None else ratio.clamp(
        min=None if low is None else 1.0 - low, max=None if high is None else 1.0 + high)
    loss = -weight * advantages * logp  # [B, T]
    return ObjectiveTerms(loss=_masked(loss, mask), ratio=ratio, clipped=(weight != ratio) & mask)


def _masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`values` with masked-out positions set to 0 (no inf/nan reaches the arithmetic)."""
    return torch.where(mask, values, 0.0)


Objective = Callable[..., ObjectiveTerms]
"""`objective(logp, proximal_logp, advantages, mask, *, settings) -> ObjectiveTerms`."""

OBJECTIVES: dict[str, Objective] = {"ppo": ppo_clip, "gspo": gspo, "cispo": cispo}
"""Config name -> policy objective (see the module docstring)."""


def get_objective(name: str) -> Objective:
    """The policy objective called `name`; ConfigError naming the valid choices otherwise."""
    return choose(OBJECTIVES, name, "policy objective")
