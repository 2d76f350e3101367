"""Regularisers: per-token KL estimates between two policies, and the entropy of a policy.

`kl_estimate(logp, ref_logp, kind)` uses only the logprobs of the sampled tokens (Schulman 2020,
"Approximating KL divergence"). With x = ref_logp - logp (log r, r = p_ref / p) on tokens sampled
from the policy of `logp` (the current policy, or whichever policy sampled them), all three
estimate the reverse KL(p || p_ref):
- k1 = -x = logp - ref_logp: unbiased, high variance, can be negative;
- k2 = x^2 / 2: biased (exact to second order), low variance, >= 0;
- k3 = e^x - x - 1: unbiased, low variance, >= 0.
Used as losses (differentiated through logp, samples fixed) they differ: in expectation k2's
gradient is that of KL(p || p_ref), k3's is that of the forward KL(p_ref || p), and k1's is 0.
`adaptive_kl_coef` is the adaptive KL controller of Ziegler et al. 2019.

Simplifications:
- x is clamped to +-LOG_RATIO_CLAMP for every kind (k3 exponentiates it).
- `entropy_from_logits` is the exact entropy of the softmax over the vocabulary; tokens with
  logit -inf (removed by top-k/top-p) contribute 0 and no nan gradient.
"""

from __future__ import annotations

from typing import Literal

import torch

from miles.errors import ConfigError
from miles.rl.ratios import clamped_log_ratio

KL_KINDS = ("k1", "k2", "k3")
"""Per-token KL estimators of `kl_estimate`."""


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor,
                kind: Literal["k1", "k2", "k3"] = "k3") -> torch.Tensor:
    """Per-token estimate of KL(p || p_ref) on tokens sampled from p (any shape, e.g. [B, T]).

    Differentiable w.r.t. both arguments; detach `ref_logp` for a KL penalty.
    """
    x = clamped_log_ratio(ref_logp, logp)  # log(p_ref / p)
    if kind == "k1":
        return -x
    if kind == "k2":
        return 0.5 * x.square()
    if kind == "k3":
        return x.exp() - x - 1.0
    raise ConfigError(f"unknown KL estimator {kind!r}; valid choices: {', '.join(KL_KINDS)}")


def k3_kl(logp: torch.Tensor, behaviour_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(behaviour || current) on behaviour-sampled tokens ([B, T]).

    With r = p_current / p_behaviour: r - log r - 1 (>= 0, unbiased, low variance; Schulman 2020).
    """
    return kl_estimate(behaviour_logp, logp, kind="k3")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy -sum_v p_v log p_v of softmax(`logits`) ([B, T, V]) per position, [B, T] (fp32)."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [B, T, V]
    finite_logp = logp.masked_fill(torch.isneginf(logp), 0.0)  # [B, T, V]
    return -(logp.exp() * finite_logp).sum(dim=-1)


KL_ERROR_CLIP = 0.2
"""Bound on the adaptive controller's proportional error (Ziegler et al. 2019, Section 2.2)."""


def adaptive_kl_coef(coef: float, *, kl: float, target: float, samples: float,
                     horizon: float) -> float:
    """The next KL coefficient of the adaptive controller of Ziegler et al. 2019 ("Fine-tuning
    language models from human preferences", Section 2.2): e = clip((kl - target) / target,
    -0.2, 0.2), coef * (1 + e * samples / horizon), with `kl` the measured KL per response and
    `samples` the responses in the step (the paper's K_beta is samples / horizon)."""
    error = min(max((kl - target) / target, -KL_ERROR_CLIP), KL_ERROR_CLIP)
    return coef * (1.0 + error * samples / horizon)
