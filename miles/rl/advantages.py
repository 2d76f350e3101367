"""Advantage estimators: critic-free ones from the outcome rewards of prompt groups, and GAE.

Critic-free estimators map the rewards of G groups of n samples ([G, n]) to advantages of the same
shape, one scalar per sample that the caller broadcasts over its response tokens:
- `grpo`: group mean subtracted, divided by the group std + eps (GRPO, Shao et al. 2024,
  "DeepSeekMath").
- `dr_grpo`: group mean subtracted, no std division (Liu et al. 2025, "Understanding R1-Zero-like
  training: a critical perspective"): the std division up-weights near-solved and near-failed
  prompts.
- `rloo`: leave-one-out baseline, the mean of the other n - 1 rewards (Ahmadian et al. 2024,
  "Back to basics: revisiting REINFORCE-style optimization").
- `reinforce_pp`: the reward (or, `baseline=True`, the group-centred reward) normalised by the
  mean and std of the whole batch (REINFORCE++, Hu 2025: global advantage normalisation).
`ADVANTAGE_ESTIMATORS` maps config names to them; every one is `estimator(rewards, *, ...)`, the
keyword-only settings having defaults.

GAE (Schulman et al. 2016, "High-dimensional continuous control using generalized advantage
estimation") works on per-token rewards and values of right-padded responses ([B, T]);
`token_rewards` builds those rewards from an outcome reward, optionally minus a per-token KL
penalty (the RLHF recipe of Ouyang et al. 2022, "InstructGPT"), and `masked_whiten` normalises
advantages over the valid tokens.

Simplifications:
- All stds are population stds (unbiased=False), so a group of one sample has std 0, not nan.
- Statistics are taken in float64 and the advantages returned in float32: in float32 the mean
  of equal rewards such as eight 0.7s is off by ~1e-8, which the division by std + eps would
  blow up to advantages of ~0.05 instead of 0.
- `reinforce_pp` normalises over samples, not tokens: with outcome rewards every token of a
  sample has the same advantage, and the batch is the [G, n] tensor given (the caller passes the
  whole global batch). `masked_whiten` likewise sees only the tensor it is given.
- GAE assumes each row's valid tokens are a prefix (right padding): the value after the last valid
  token is 0 (the episode ended), and padded positions get advantage and return 0.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from miles.config import choose

AdvantageEstimator = Callable[..., torch.Tensor]
"""`estimator(rewards [G, n], *, settings with defaults) -> advantages [G, n]`."""


def grpo_advantages(rewards: torch.Tensor, *, scale_by_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages of `rewards` ([G, n]: G groups of n samples), shape [G, n].

    A_ij = r_ij - mean_j(r_i), divided by (std_j(r_i) + eps) when `scale_by_std` (population std,
    unbiased=False). A group whose rewards are all equal gets zero advantages.
    """
    rewards = rewards.double()  # fp32 means of equal rewards (0.7 x 8) leave noise ~1e-8
    centred = rewards - rewards.mean(dim=-1, keepdim=True)  # [G, n]
    if not scale_by_std:
        return centred.float()
    std = rewards.std(dim=-1, unbiased=False, keepdim=True)  # [G, 1]
    return (centred / (std + eps)).float()


def dr_grpo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO advantages ([G, n]): the reward minus its group mean, not divided by the std."""
    return grpo_advantages(rewards, scale_by_std=False)


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """RLOO advantages ([G, n]): A_i = r_i - mean_{j != i} r_j = n / (n - 1) * (r_i - mean_j r_j).

    A group of one sample has no other sample to compare with and gets advantage 0.
    """
    n = rewards.shape[-1]
    if n < 2:
        return torch.zeros_like(rewards, dtype=torch.float32)
    return dr_grpo_advantages(rewards) * (n / (n - 1))


def reinforce_pp_advantages(rewards: torch.Tensor, *, baseline: bool = False,
                            eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++ advantages ([G, n]): (x - mean(x)) / (std(x) + eps) over the whole batch.

    x is the reward, or with `baseline` the reward minus its group mean (REINFORCE++-baseline).
    Mean and (population) std are taken over all G * n samples, not per group.
    """
    x = (dr_grpo_advantages(rewards) if baseline else rewards).double()  # [G, n]
    return ((x - x.mean()) / (x.std(unbiased=False) + eps)).float()


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_pp": reinforce_pp_advantages,
}
"""Config name -> critic-free advantage estimator (see the module docstring)."""


def get_estimator(name: str) -> AdvantageEstimator:
    """The advantage estimator called `name`; ConfigError naming the valid choices otherwise."""
    return choose(ADVANTAGE_ESTIMATORS, name, "advantage estimator")


def gae_advantages(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *,
                   gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE advantages and returns of right-padded responses, both [B, T].

    delta_t = r_t + gamma * V_{t+1} - V_t with V = 0 at and after the first padded position;
    A_t = delta_t + gamma * lam * A_{t+1}; returns = A + V. `rewards`, `values` are [B, T],
    `mask` [B, T] bool; padded entries are ignored (may hold inf/nan) and come out 0.
    """
    rewards = torch.where(mask, rewards.detach().float(), 0.0)  # [B, T]
    values = torch.where(mask, values.detach().float(), 0.0)  # [B, T]
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], dim=1)  # [B, T]
    deltas = rewards + gamma * next_values - values  # [B, T]
    advantages = torch.zeros_like(deltas)  # [B, T]
    running = torch.zeros_like(deltas[:, 0])  # [B]
    for t in reversed(range(deltas.shape[1])):
        running = deltas[:, t] + gamma * lam * running
        advantages[:, t] = running
    advantages = torch.where(mask, advantages, 0.0)
    return advantages, advantages + values


def token_rewards(outcome: torch.Tensor, mask: torch.Tensor,
                  kl_penalty: torch.Tensor | None = None, coef: float = 0.0) -> torch.Tensor:
    """Per-token rewards [B, T]: `outcome` ([B]) on each row's last valid token, minus
    `coef * kl_penalty` ([B, T], e.g. a per-token KL estimate) on every valid token.

    `mask` is [B, T] bool; padded positions and rows without a valid token get 0. Detached.
    """
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)  # [B, T]
    last = torch.where(mask, positions, -1).amax(dim=1, keepdim=True)  # [B, 1], -1: empty row
    rewards = torch.where(positions == last, outcome.detach().float().unsqueeze(1), 0.0)
    if kl_penalty is not None:
        rewards = rewards - coef * kl_penalty.detach().float()
    return torch.where(mask, rewards, 0.0)  # [B, T]


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True,
                  eps: float = 1e-8) -> torch.Tensor:
    """`values` ([B, T]) normalised by the mean and (population) std of its valid tokens.

    (v - mean) / sqrt(var + eps); with `shift_mean=False` the mean is added back (scale only).
    Padded positions (`mask` [B, T] bool False) come out 0. Detached.
    """
    values = torch.where(mask, values.detach().float(), 0.0)  # [B, T]
    count = mask.sum().clamp(min=1)
    mean = values.sum() / count
    var = torch.where(mask, (values - mean) ** 2, 0.0).sum() / count
    whitened = (values - mean) * torch.rsqrt(var + eps)  # [B, T]
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask, whitened, 0.0)
