"""The KL-to-reference coefficient of a run, and the KL penalty in the critic-free rewards.

`KLPenalty` holds the coefficient `loss.kl_coef`, fixed or, with `loss.kl_target`, adapted after
every applied step (Ziegler et al. 2019, Section 2.2: `miles.rl.kl.adaptive_kl_coef`) from the
KL per response measured on the step's batch: the k1 KL of the sampling policy to the reference,
sum(behaviour - reference) over a response's trained tokens, averaged over the batch's responses
on all ranks. The coefficient goes either into the policy loss (`loss_settings`) or, under
`kl_in_reward`, into the reward (never both: `AlgorithmConfig.policy_loss_settings`):
- with the critic (gae), the learner subtracts `coef` x k1 per token from the GAE rewards;
- critic-free, `prepare` replaces the outcome advantages of every micro-batch: `reinforce_pp`
  takes per-token returns x - coef * sum_{i >= t} k1_i (x the reward, or the group-centred
  reward with `advantage.baseline`) whitened over the tokens of the global batch (REINFORCE++,
  Hu 2025); `grpo`, `dr_grpo`, `rloo` apply their group estimator to r - coef * sum_t k1_t, the
  whole response as one action (RLOO, Ahmadian et al. 2024).

Simplifications:
- The learner gives every rank whole groups, so the group estimators need no collective; the
  batch statistics of `reinforce_pp` and of the measured KL are all-reduced.
- A masked truncated response (`mask_truncated`) has no trained token: no KL is counted for it,
  and it stays in its group's baseline with its plain reward.

Checkpoints: the coefficient goes into the checkpoint's meta.json (`checkpoint_meta`, key
`kl_coef`), not the learner's state dict, so checkpoints written before it existed still load;
`resume` takes it back under the adaptive controller (a fixed coefficient is the config's). A
checkpoint without it resumes from `loss.kl_coef`, and says so in the log.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict

import torch

from miles.errors import CheckpointError
from miles.rl.advantages import batch_advantages, kl_penalised_returns, kl_penalised_rewards
from miles.rl.algorithm import AlgorithmConfig
from miles.rl.kl import adaptive_kl_coef, kl_estimate
from miles.rl.losses import LossSettings
from miles.trainer import distributed

log = logging.getLogger(__name__)
META_KEY = "kl_coef"  # the coefficient of the next step, in a checkpoint's meta.json


class KLPenalty:
    """The KL coefficient of a learner and the critic-free KL-in-reward advantages."""

    def __init__(self, algorithm: AlgorithmConfig):
        self.algorithm = algorithm
        self.coef = algorithm.loss.kl_coef  # the coefficient of the next step
        self.used = self.coef  # the coefficient of the last prepared step
        self.kl = 0.0  # KL per response of the last prepared batch (all ranks)
        self.responses = 0.0  # responses it was measured over

    def loss_settings(self) -> LossSettings:
        """The settings of the policy loss with the current KL coefficient (none in the loss
        under kl_in_reward)."""
        return self.algorithm.policy_loss_settings(self.coef)

    def prepare(self, batches: list, extras: list) -> None:
        """After every micro-batch of the step has its reference logprobs (`extras[i].reference`
        [B, L-1] for `batches[i]`): measure the KL per response and, critic-free under
        kl_in_reward, set each `extras[i].advantages` ([B, 1] or [B, L-1])."""
        if not self.algorithm.uses_reference:
            return
        kls = [self._token_kl(b, e) for b, e in zip(batches, extras)]  # [B, L-1] each
        masks = [b.response_mask.to(e.reference.device) for b, e in zip(batches, extras)]
        local = torch.zeros(2, dtype=torch.float64)
        for kl, mask in zip(kls, masks):
            rows = mask.any(dim=-1)  # [B]
            local += torch.stack([torch.where(mask, kl, 0.0).sum(-1)[rows].sum().double().cpu(),
                                  rows.sum().double().cpu()])
        total, responses = distributed.all_reduce_sum(local).tolist()
        self.kl, self.responses, self.used = total / max(responses, 1.0), responses, self.coef
        a = self.algorithm
        if a.kl_in_reward and not a.uses_critic:
            shape = self._returns if a.estimator == "reinforce_pp" else self._group_rewards
            shape(batches, extras, kls, masks)

    def update(self) -> None:
        """After an applied step: the adaptive controller's next coefficient (if configured)."""
        loss = self.algorithm.loss
        if loss.kl_target is not None and self.responses > 0:
            self.coef = adaptive_kl_coef(self.coef, kl=self.kl, target=loss.kl_target,
                                         samples=self.responses, horizon=loss.kl_horizon)

    def checkpoint_meta(self) -> dict[str, float]:
        """What a checkpoint's meta.json records of the KL penalty: the next step's coefficient."""
        return {META_KEY: self.coef}

    def resume(self, meta: dict) -> None:
        """Take the adapted coefficient back from a checkpoint's `meta` (adaptive controller
        only: a fixed coefficient is `loss.kl_coef`). CheckpointError on a value that is not a
        positive finite number."""
        loss = self.algorithm.loss
        if loss.kl_target is None:
            return
        if META_KEY not in meta:
            log.warning("checkpoint of step %s has no %s (written before the adaptive KL "
                        "coefficient was checkpointed): the controller starts again from "
                        "loss.kl_coef=%g", meta.get("step"), META_KEY, loss.kl_coef)
            return
        coef = meta[META_KEY]
        if isinstance(coef, bool) or not isinstance(coef, (int, float)) or \
                not math.isfinite(coef) or coef <= 0:
            raise CheckpointError(f"checkpoint of step {meta.get('step')}: {META_KEY} must be a "
                                  f"positive finite number, got {coef!r}")
        self.coef = self.used = float(coef)
        log.info("adaptive KL coefficient resumed at %g (loss.kl_coef=%g)", self.coef,
                 loss.kl_coef)

    def metrics(self) -> dict[str, float]:
        """`trainer/kl_coef` (the step's coefficient) and `trainer/kl_response` (its KL per
        response) when a reference is used."""
        if not self.algorithm.uses_reference:
            return {}
        return {"trainer/kl_coef": self.used, "trainer/kl_response": self.kl}

    @staticmethod
    def _token_kl(batch, extra) -> torch.Tensor:
        """k1 KL of the sampling policy to the reference per token, [B, L-1]."""
        behaviour = batch.behaviour_logprobs.to(extra.reference.device)
        return kl_estimate(behaviour, extra.reference, "k1")

    def _group_rewards(self, batches, extras, kls, masks) -> None:
        """Group estimators on the KL-penalised sequence rewards (every group is on this rank)."""
        penalised, where = defaultdict(dict), []
        for batch, kl, mask in zip(batches, kls, masks):
            rewards = kl_penalised_rewards(batch.rewards.to(kl.device), kl, mask, self.used)
            for row, (group_id, index) in enumerate(batch.sample_ids):
                penalised[group_id][index] = rewards[row]
            where.append(batch.sample_ids)
        ids = list(penalised)
        advantages = batch_advantages(
            [torch.stack([penalised[g][i] for i in sorted(penalised[g])]) for g in ids],
            estimator=self.algorithm.estimator, settings=self.algorithm.advantage)
        by_id = {g: dict(zip(sorted(penalised[g]), adv.tolist()))
                 for g, adv in zip(ids, advantages)}
        for batch, extra, kl, sample_ids in zip(batches, extras, kls, where):
            values = [by_id[g][i] for g, i in sample_ids]
            values += [0.0] * (len(batch.rewards) - len(values))  # an idle micro-batch's row
            extra.advantages = torch.tensor(values, device=kl.device).unsqueeze(1)  # [B, 1]

    def _returns(self, batches, extras, kls, masks) -> None:
        """REINFORCE++: KL-penalised per-token returns, whitened over the global batch's tokens."""
        s = self.algorithm.advantage
        means = self._group_means(batches) if s.baseline else None
        returns = []
        for batch, kl, mask in zip(batches, kls, masks):
            x = batch.rewards.double().clone()  # [B]
            if means is not None:
                for row, (group_id, _) in enumerate(batch.sample_ids):
                    x[row] -= means[group_id]
            returns.append(kl_penalised_returns(x.to(kl.device), kl, mask, self.used))
        local = torch.zeros(3, dtype=torch.float64)
        for g, mask in zip(returns, masks):
            values = g[mask]
            local += torch.stack([values.sum(), (values ** 2).sum(),
                                  torch.tensor(float(values.numel()), dtype=torch.float64,
                                               device=values.device)]).cpu()
        total, squares, count = distributed.all_reduce_sum(local).tolist()
        for extra, g, mask in zip(extras, returns, masks):
            extra.advantages = torch.where(
                mask, self._whitened(g, total, squares, count), 0.0).float()  # [B, L-1]

    def _whitened(self, values: torch.Tensor, total: float, squares: float,
                  count: float) -> torch.Tensor:
        """`values` normalised by the global token statistics (sum, sum of squares, count)."""
        s = self.algorithm.advantage
        mean = total / max(count, 1.0)
        scale = True if s.scale_by_std is None else s.scale_by_std
        if not scale:
            return values - mean
        denominator = count - 1 if s.unbiased_std else count
        var = max(squares - count * mean ** 2, 0.0) / denominator if denominator > 0 else 0.0
        return (values - mean) / (var ** 0.5 + s.eps)

    @staticmethod
    def _group_means(batches) -> dict[str, float]:
        """Mean (shaped) reward of each group on this rank."""
        sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        for batch in batches:
            for row, (group_id, _) in enumerate(batch.sample_ids):
                sums[group_id][0] += float(batch.rewards[row])
                sums[group_id][1] += 1.0
        return {g: total / n for g, (total, n) in sums.items()}
