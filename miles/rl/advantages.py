"""Advantage estimators: per-sample advantages from the rewards of a prompt group.

Simplifications:
- Outcome rewards only: one scalar per sample, broadcast over its response tokens by the caller.
  Per-token rewards (`Sample.token_rewards`) are not used yet.
- One estimator, GRPO's group-normalised reward. A registry mapping config names to estimators
  (RLOO, Dr. GRPO, ...) comes when a second one exists; every estimator keeps this signature.
"""

from __future__ import annotations

import torch


def grpo_advantages(rewards: torch.Tensor, *, scale_by_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages of `rewards` ([G, n]: G groups of n samples), shape [G, n].

    A_ij = r_ij - mean_j(r_i), divided by (std_j(r_i) + eps) when `scale_by_std` (population std,
    unbiased=False). A group whose rewards are all equal gets zero advantages.
    """
    rewards = rewards.float()
    centred = rewards - rewards.mean(dim=-1, keepdim=True)  # [G, n]
    if not scale_by_std:
        return centred
    std = rewards.std(dim=-1, unbiased=False, keepdim=True)  # [G, 1]
    return centred / (std + eps)
