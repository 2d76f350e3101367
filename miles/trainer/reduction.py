"""A train step's metrics: summed over micro-batches, updates and ranks, then divided once.

Per-token metrics (`compute_policy_loss`'s sums, the critic's) are divided by the token count
summed the same way: a mean over every token of every update. The loss terms are each update's
aggregated loss (global normalisers: micro-batches and ranks add up to the update's loss),
divided by the number of updates: the mean over the step's updates of what was backpropagated.

- `trainer/loss` = `policy_loss` + `kl_loss` + `entropy_loss` + value_coef * `value_loss`, the
  total loss backpropagated, aggregated as configured (`loss.aggregation`; the critic's
  token mean); the terms carry their coefficients and signs (`entropy_loss` = -entropy_coef * H).
- `trainer/clip_frac` = `clip_frac_low` (ratio below 1) + `clip_frac_high` (ratio above 1);
  `approx_kl_prox` is k3 KL(proximal || current) on the sampled tokens.
- `trainer/tokens` and `trainer/reward_mean` cover every sample of the batch;
  `trainer/skipped_samples` got no forward (`LearnerConfig.skip_zero_advantage`), so the
  per-token metrics (clip fractions, KLs, entropy, IS weights) are means over the others.
- Gradient norms are pre-clip and the largest over the step's updates; `grad_norm` is the joint
  norm sqrt(actor^2 + critic^2), the two are clipped separately.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles.rl.aggregation import Normalisers
from miles.rl.losses import MAX_METRICS
from miles.trainer import distributed
from miles.trainer.batching import MicroBatch

LOSS_SUMS = ("loss_sum", "value_loss_sum")  # the metrics whose non-finiteness fails a step
LOSS_TERMS = ("policy_loss", "kl_loss", "entropy_loss", "value_loss")  # per update, aggregated


def finite_losses(sums: dict[str, torch.Tensor]) -> bool:
    """This rank's accumulated policy and value losses are finite."""
    return all(bool(torch.isfinite(sums[k]).all()) for k in LOSS_SUMS if k in sums)


def add_metrics(total: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> None:
    """Fold one micro-batch's metrics into `total` (sum, or max for MAX_METRICS)."""
    for key, value in new.items():
        if key not in total:
            total[key] = value
        elif key in MAX_METRICS:
            total[key] = torch.maximum(total[key], value)
        else:
            total[key] = total[key] + value


@dataclass(frozen=True)
class StepCounts:
    """What a step trained on: the whole batch's counts (the same on every rank) and this
    rank's forwarded samples."""

    reward_sum: float  # shaped rewards of every sample
    samples: int
    tokens: float  # trained response tokens (the token normaliser, summed over the slices)
    forwarded: int  # samples this rank ran a forward for (the rest were skipped as inert)


def step_counts(rewards: list[torch.Tensor], normalisers: list[Normalisers],
                slices: list[list[MicroBatch]]) -> StepCounts:
    """The counts of a step from its groups' shaped `rewards` ([n] each), its slices'
    `normalisers` and this rank's micro-batches."""
    return StepCounts(reward_sum=float(sum(float(r.sum()) for r in rewards)),
                      samples=sum(len(r) for r in rewards),
                      tokens=float(sum(n.tokens for n in normalisers)),
                      forwarded=sum(len(b.sample_ids) for batches in slices for b in batches))


def reduce_step(sums: dict[str, torch.Tensor], norms: list[tuple[float, float]],
                counts: StepCounts, *, updates: int, value_coef: float,
                policy_version: int) -> dict[str, float]:
    """The step's metrics from this rank's `sums` (a collective); `norms`: (actor, critic)
    pre-clip gradient norms of each update; `counts`: `step_counts`."""
    forwarded = distributed.all_reduce_sum(
        torch.tensor([float(counts.forwarded)], dtype=torch.float64)).item()
    keys = sorted(k for k in sums if k not in MAX_METRICS)
    s = dict(zip(keys, distributed.all_reduce_sum(
        torch.stack([sums[k].double() for k in keys])).tolist())) if keys else {}
    actor, critic = max(n[0] for n in norms), max(n[1] for n in norms)
    out = {"trainer/grad_norm": max((a * a + c * c) ** 0.5 for a, c in norms),
           "trainer/actor_grad_norm": actor, "trainer/tokens": counts.tokens,
           "trainer/reward_mean": counts.reward_sum / max(counts.samples, 1),
           "trainer/skipped_samples": float(counts.samples - forwarded),
           "trainer/updates": float(updates),
           "trainer/policy_version": float(policy_version)}
    per_update = {k: s[k] / max(updates, 1) for k in LOSS_TERMS if k in s}
    out.update({f"trainer/{k}": v for k, v in per_update.items()})
    out["trainer/loss"] = sum(v for k, v in per_update.items() if k != "value_loss") + \
        value_coef * per_update.get("value_loss", 0.0)
    if "tokens" in s:
        out.update(policy_metrics(s, sums))
    if "value_tokens" in s:
        out["trainer/critic_grad_norm"] = critic
        out.update(value_metrics(s))
    return out


def policy_metrics(s: dict[str, float], sums: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per-token means of the summed `compute_policy_loss` metrics `s` (over all ranks)."""
    n = max(s["tokens"], 1.0)
    weight_max = distributed.all_reduce_max(sums["is_weight_max"].double().reshape(1))
    out = {
        "trainer/clip_frac": s["clipped"] / n,
        "trainer/clip_frac_low": s["clipped_low"] / n,
        "trainer/clip_frac_high": s["clipped_high"] / n,
        "trainer/approx_kl_prox": s["kl_proximal_sum"] / n,
        "trainer/kl_behaviour": s["kl_behaviour_sum"] / n,
        "trainer/kl_mismatch": s["kl_mismatch_sum"] / n,
        "trainer/is_weight_mean": s["is_weight_sum"] / n,
        "trainer/is_weight_max": float(weight_max[0]),
        "trainer/is_truncated_frac": s["is_truncated"] / n,
        "trainer/is_masked_frac": s["is_masked"] / n,
        "trainer/mismatch": s["mismatch_sum"] / n,
    }
    if "kl_ref_sum" in s:
        out["trainer/kl_ref"] = s["kl_ref_sum"] / n
    if "entropy_sum" in s:
        out["trainer/entropy"] = s["entropy_sum"] / n
    return out


def value_metrics(s: dict[str, float]) -> dict[str, float]:
    """Per-token means of the critic's summed metrics (over all ranks and updates)."""
    n = max(s["value_tokens"], 1.0)
    return {"trainer/value_clip_frac": s["value_clipped"] / n,
            "trainer/value_mean": s["value_sum"] / n,
            "trainer/return_mean": s["return_sum"] / n}
