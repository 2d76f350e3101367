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
- `reinforce_pp`: the reward (or, `baseline=True`, the group-centred reward: REINFORCE++-baseline)
  normalised by the mean and std of the whole batch (REINFORCE++, Hu 2025: global advantage
  normalisation, over the batch's tokens).
`ADVANTAGE_ESTIMATORS` maps config names to them; every one is `estimator(rewards, *, ...)`, the
keyword-only settings having defaults. `batch_advantages` applies one to a batch of groups of
any sizes with the knobs of `AdvantageSettings`; `kl_penalised_returns` and
`kl_penalised_rewards` put a per-token KL penalty into the reward first (`kl_in_reward`).

GAE (Schulman et al. 2016, "High-dimensional continuous control using generalized advantage
estimation") works on per-token rewards and values of right-padded responses ([B, T]);
`token_rewards` builds those rewards from the rewards earned at tokens (an episode's per-turn
rewards) and the outcome reward (the return: what the steps leave of it goes on the last
token), optionally minus a per-token KL penalty (the RLHF recipe of Ouyang et al. 2022,
"InstructGPT"), and `masked_whiten` normalises advantages over the valid tokens.

Simplifications:
- Stds are population stds by default (`unbiased_std` for Bessel's n - 1, which TRL and verl use:
  `torch.std`'s default): GRPO's formula writes std(r) of the group itself, the population std
  is defined for a group of one (0, where n - 1 gives nan), and for small groups it does not
  inflate advantages by sqrt(n / (n - 1)) (1.07 at n = 8). A group of one has std 0 either way.
- Statistics are taken in float64 and the advantages returned in float32: in float32 the mean
  of equal rewards such as eight 0.7s is off by ~1e-8, which the division by std + eps would
  blow up to advantages of ~0.05 instead of 0.
- With outcome rewards every token of a sample has the same advantage, so normalising over tokens
  is a weighted normalisation over samples (`weights`: each sample's trained tokens);
  `normalise_over="samples"` weighs each sample once. The batch is what the caller gives (the
  trainer passes the whole global batch). `masked_whiten` likewise sees only its tensor.
- GAE runs over each row's valid tokens in order, whatever lies between them: the valid tokens
  are moved to the front of the row (`compress`), GAE runs there, the results go back to their
  positions. For a multi-turn episode the valid tokens are the policy's, so one turn's last
  token bootstraps from the next turn's first (gamma and lambda discount per policy token; the
  environment's observation tokens are no steps). The value after a row's last valid token is
  0 (the episode ended); other positions get advantage and return 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from miles.config import choose
from miles.errors import ConfigError

DEFAULT_STD_EPS = 1e-6
"""Added to a std before dividing by it (GRPO, REINFORCE++): a group or batch whose rewards are
nearly equal gets large but finite advantages (its centred rewards are ~0 anyway)."""

NORMALISE_OVER = ("tokens", "samples")
"""What REINFORCE++'s batch statistics count: every response token, or every sample once."""

AdvantageEstimator = Callable[..., torch.Tensor]
"""`estimator(rewards [G, n], *, settings with defaults) -> advantages [G, n]`."""


def group_std(rewards: torch.Tensor, *, unbiased: bool = False) -> torch.Tensor:
    """Std of each group of `rewards` ([G, n], float64) over its samples, [G, 1]: population
    (divide by n) or, `unbiased`, Bessel-corrected (n - 1); a group of one sample has std 0."""
    if rewards.shape[-1] < 2:
        return torch.zeros_like(rewards[..., :1])
    return rewards.std(dim=-1, unbiased=unbiased, keepdim=True)


def grpo_advantages(rewards: torch.Tensor, *, scale_by_std: bool = True,
                    eps: float = DEFAULT_STD_EPS, unbiased: bool = False) -> torch.Tensor:
    """GRPO advantages of `rewards` ([G, n]: G groups of n samples), shape [G, n].

    A_ij = r_ij - mean_j(r_i), divided by (std_j(r_i) + eps) when `scale_by_std` (population std
    unless `unbiased`). A group whose rewards are all equal gets zero advantages.
    """
    rewards = rewards.double()  # fp32 means of equal rewards (0.7 x 8) leave noise ~1e-8
    centred = rewards - rewards.mean(dim=-1, keepdim=True)  # [G, n]
    if not scale_by_std:
        return centred.float()
    return (centred / (group_std(rewards, unbiased=unbiased) + eps)).float()


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
                            eps: float = DEFAULT_STD_EPS, unbiased: bool = False,
                            scale_by_std: bool = True,
                            weights: torch.Tensor | None = None) -> torch.Tensor:
    """REINFORCE++ advantages ([G, n]): (x - mean(x)) / (std(x) + eps) over the whole batch.

    x is the reward, or with `baseline` the reward minus its group mean (REINFORCE++-baseline).
    Mean and std are taken over all G * n samples, each counted `weights` times ([G, n], e.g. its
    response tokens: the paper's normalisation over the tokens of the batch; None: once).
    """
    x = (dr_grpo_advantages(rewards) if baseline else rewards).double()  # [G, n]
    w = torch.ones_like(x) if weights is None else weights.double()  # [G, n]
    return whiten(x.reshape(-1), w.reshape(-1), eps=eps, unbiased=unbiased,
                  scale_by_std=scale_by_std).reshape(x.shape).float()


def whiten(x: torch.Tensor, weights: torch.Tensor, *, eps: float, unbiased: bool,
           scale_by_std: bool = True) -> torch.Tensor:
    """(x - mean) / (std + eps) of `x` ([N]) where entry i counts `weights[i]` times ([N], >= 0);
    float64. Unbiased: the variance is divided by (sum of weights - 1). Without `scale_by_std`
    only the mean is subtracted. No weight at all: zeros."""
    total = float(weights.sum())
    if total <= 0:
        return torch.zeros_like(x)
    mean = (weights * x).sum() / total
    if not scale_by_std:
        return x - mean
    denominator = total - 1 if unbiased else total
    var = (weights * (x - mean) ** 2).sum() / denominator if denominator > 0 else 0.0 * mean
    return (x - mean) / (var.sqrt() + eps)


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


@dataclass(frozen=True, kw_only=True)
class AdvantageSettings:
    """Knobs of the critic-free estimators (`batch_advantages`); each names who reads it."""

    eps: float = DEFAULT_STD_EPS  # grpo, reinforce_pp: added to the std before dividing
    scale_by_std: bool | None = None  # grpo, dr_grpo, reinforce_pp: divide by the std; None:
    # the estimator's own (grpo, reinforce_pp yes; dr_grpo no: dr_grpo with true is grpo)
    unbiased_std: bool = False  # grpo, reinforce_pp: Bessel-corrected std (n - 1); default the
    # population std (n), defined for a group of one and what GRPO's formula writes
    baseline: bool = False  # reinforce_pp: subtract the group mean first (REINFORCE++-baseline)
    normalise_over: Literal["tokens", "samples"] = "tokens"  # reinforce_pp: batch mean and std
    # over every response token (the paper's, Hu 2025), or over samples (each counted once)

    def __post_init__(self) -> None:
        if not self.eps > 0:
            raise ConfigError(f"advantage.eps must be > 0, got {self.eps}")
        if self.normalise_over not in NORMALISE_OVER:
            raise ConfigError(f"advantage.normalise_over must be one of {list(NORMALISE_OVER)}, "
                              f"got {self.normalise_over!r}")

    def check(self, estimator: str) -> None:
        """ConfigError when a knob is set that `estimator` does not read (it would do nothing)."""
        unread = [name for name, is_set, readers in (
            ("scale_by_std", self.scale_by_std is not None, ("grpo", "dr_grpo", "reinforce_pp")),
            ("unbiased_std", self.unbiased_std, ("grpo", "dr_grpo", "reinforce_pp")),
            ("baseline", self.baseline, ("reinforce_pp",)),
            ("normalise_over", self.normalise_over != "tokens", ("reinforce_pp",)),
        ) if is_set and estimator not in readers]
        if unread:
            raise ConfigError(f"advantage.{', advantage.'.join(unread)}: not read by estimator "
                              f"{estimator!r} (leave at the default)")


def batch_advantages(rewards: list[torch.Tensor], *, estimator: str,
                     settings: AdvantageSettings = AdvantageSettings(),
                     weights: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Advantages of a batch of groups of any sizes (`rewards`: one [n_i] tensor per group), one
    [n_i] float32 tensor per group. Group estimators see each group alone; `reinforce_pp` sees
    the whole batch, each sample counted `weights` times (one [n_i] tensor per group, e.g. its
    response tokens) under `normalise_over="tokens"`, once under "samples"."""
    if not rewards:
        return []
    get_estimator(estimator)
    s = settings
    if estimator == "reinforce_pp":
        x = torch.cat([dr_grpo_advantages(r.unsqueeze(0))[0].double() if s.baseline else
                       r.double() for r in rewards])  # [N]
        counted = weights if weights is not None and s.normalise_over == "tokens" else None
        w = torch.ones_like(x) if counted is None else torch.cat(counted).double()  # [N]
        scale = True if s.scale_by_std is None else s.scale_by_std
        out = whiten(x, w, eps=s.eps, unbiased=s.unbiased_std, scale_by_std=scale).float()
        return list(out.split([len(r) for r in rewards]))
    if estimator == "rloo":
        return [rloo_advantages(r.unsqueeze(0))[0] for r in rewards]
    default_scale = estimator == "grpo"
    scale = default_scale if s.scale_by_std is None else s.scale_by_std
    return [grpo_advantages(r.unsqueeze(0), scale_by_std=scale, eps=s.eps,
                            unbiased=s.unbiased_std)[0] for r in rewards]


def gae_advantages(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *,
                   gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE advantages and returns over each row's valid tokens, both [B, T].

    With v_1 .. v_m the row's valid tokens in order (any positions: a prompt before them,
    padding or an episode's observation tokens between and after them):
    delta_k = r_k + gamma * V_{k+1} - V_k with V_{m+1} = 0; A_k = delta_k + gamma * lam *
    A_{k+1}; returns = A + V. `rewards`, `values` are [B, T], `mask` [B, T] bool; entries off
    the mask are ignored (may hold inf/nan) and come out 0.
    """
    order = compress(mask)  # [B, T]: the valid positions first, in order
    packed = mask.gather(1, order)  # [B, T]: a prefix of each row
    advantages, returns = _prefix_gae(rewards.detach().float().gather(1, order),
                                      values.detach().float().gather(1, order), packed,
                                      gamma=gamma, lam=lam)
    return (torch.zeros_like(advantages).scatter(1, order, advantages),
            torch.zeros_like(returns).scatter(1, order, returns))


def compress(mask: torch.Tensor) -> torch.Tensor:
    """[B, T] int64 permutation of each row putting its `mask`ed positions first, in order
    (`x.gather(1, order)` packs them; `scatter(1, order, .)` puts them back)."""
    return torch.argsort((~mask).to(torch.int8), dim=1, stable=True)


def _prefix_gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *,
                gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE of rows whose valid tokens are a prefix (`gae_advantages` after `compress`)."""
    rewards = torch.where(mask, rewards, 0.0)  # [B, T]
    values = torch.where(mask, values, 0.0)  # [B, T]
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
                  kl_penalty: torch.Tensor | None = None, coef: float = 0.0, *,
                  steps: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token rewards [B, T]: `steps` ([B, T], rewards earned at tokens, e.g. an episode's
    per-turn rewards; None: none) on each row's valid tokens, plus the remainder `outcome`
    ([B], the return) - the sum of those steps on the row's last valid token, minus
    `coef * kl_penalty` ([B, T], e.g. a per-token KL estimate) on every valid token.

    Without the penalty a row's rewards sum to its `outcome` (gamma 1): a step off the mask
    is not lost but lands, through the remainder, on the last valid token. Without `steps`
    (or all of them 0) the rewards are `outcome` on the last valid token, bit for bit.
    `mask` is [B, T] bool; padded positions and rows without a valid token get 0. Detached.
    """
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)  # [B, T]
    last = torch.where(mask, positions, -1).amax(dim=1, keepdim=True)  # [B, 1], -1: empty row
    outcome = outcome.detach().float()  # [B]
    rewards = torch.zeros(mask.shape, device=mask.device)  # [B, T]
    if steps is not None:
        rewards = torch.where(mask, steps.detach().float(), 0.0)  # [B, T]
        outcome = (outcome.double() - rewards.double().sum(dim=1)).float()  # [B] remainder
    rewards = rewards + torch.where(positions == last, outcome.unsqueeze(1), 0.0)
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


def kl_penalised_rewards(rewards: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor,
                         coef: float) -> torch.Tensor:
    """Sequence rewards [B] minus `coef` x the sum of the per-token `kl` ([B, T]) over each
    row's `mask`ed tokens: the KL-penalised reward of RLOO (Ahmadian et al. 2024: the whole
    response is one action), before a group estimator."""
    return rewards.double() - coef * torch.where(mask, kl.double(), 0.0).sum(dim=-1)


def kl_penalised_returns(outcome: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor,
                         coef: float) -> torch.Tensor:
    """Per-token returns [B, T] of an outcome reward ([B], at the last token) with a per-token
    KL penalty: G_t = outcome - coef * sum_{i >= t} kl_i over the row's `mask`ed tokens (gamma 1;
    REINFORCE++, Hu 2025). Padded positions are 0. float64."""
    penalty = torch.where(mask, kl.double(), 0.0)  # [B, T]
    to_go = penalty.flip(-1).cumsum(-1).flip(-1)  # [B, T] sum over i >= t
    return torch.where(mask, outcome.double().unsqueeze(-1) - coef * to_go, 0.0)
