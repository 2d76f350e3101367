"""The learner: one FSDP2-sharded policy (LoRA by default), its optimizer, and the train step.

`train_step(groups)`: every rank receives the same list of groups and trains on its share
(`groups[rank::world_size]`). It (a) accumulates gradients over all micro-batches of the loss
normalised by the response-token count of the whole global batch (all ranks), so the update is
the token-mean over the global batch whatever the split, (b) clips the gradient norm and takes
one optimizer step, which increments `policy_version`.

Simplifications:
- One optimizer step per `train_step`: the weights do not change until every micro-batch has
  been scored, so the proximal policy of decoupled PPO *is* the current one and its logprobs are
  the detached logprobs of the training forward (no second forward pass). The PPO ratio is then
  1 and `trainer/clip_frac` is 0; what corrects off-policy data is the truncated behaviour
  importance weight. Several mini-batch steps per call, which need a separate proximal pass,
  come later.
- Gradients are reduce-scattered after every micro-batch (FSDP2's default), not only after the
  last: simple and memory-lean; LoRA gradients are small.
- A rank with fewer micro-batches runs idle ones (no response token) so every rank makes the
  same FSDP collectives.
- A step whose gradient norm is not finite is skipped (`trainer/skipped_step` = 1) and does not
  count as a policy version.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from miles.errors import ConfigError, MilesError
from miles.protocol import TrajectoryGroup
from miles.rl.losses import MAX_METRICS, policy_loss
from miles.rl.sampling import sampled_logprobs
from miles.trainer import distributed
from miles.trainer.batching import MicroBatch, idle_micro_batch, make_micro_batches
from miles.trainer.model import (LoraSettings, apply_fsdp, export_adapter, load_policy,
                                 trainable_names)

LOGPROB_FLOOR = -100.0
"""Trainer logprobs are floored here: a sampled token the trainer's top-k/top-p filter removes
(logprob -inf, engine/trainer mismatch at the filter edge) gets a tiny importance weight and no
gradient instead of a nan from -inf - -inf."""


@dataclass(frozen=True, kw_only=True)
class LearnerConfig:
    """Optimizer and loss settings of the learner."""

    lr: float = 1e-4  # AdamW learning rate (LoRA tolerates ~10x the full fine-tuning rate)
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW moment decay rates
    adam_eps: float = 1e-8  # AdamW denominator epsilon
    clip_low: float = 0.2  # PPO ratio lower clip: 1 - clip_low
    clip_high: float = 0.28  # PPO ratio upper clip: 1 + clip_high (clip-higher, DAPO)
    is_cap: float = 2.0  # truncation of the behaviour importance weight proximal/behaviour
    grad_clip: float = 1.0  # max global gradient norm (inf disables clipping)
    max_tokens_per_micro_batch: int = 8192  # padded tokens (rows x longest) per forward
    scale_advantages_by_std: bool = True  # GRPO: divide the group-centred reward by its std
    seed: int = 0  # seeds the LoRA init (identical on every rank) and torch's RNG

    def __post_init__(self) -> None:
        checks = [
            (self.lr > 0, f"trainer.lr must be > 0, got {self.lr}"),
            (self.weight_decay >= 0,
             f"trainer.weight_decay must be >= 0, got {self.weight_decay}"),
            (len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
             f"trainer.betas must be two values in [0, 1), got {self.betas}"),
            (self.adam_eps > 0, f"trainer.adam_eps must be > 0, got {self.adam_eps}"),
            (0 <= self.clip_low < 1, f"trainer.clip_low must be in [0, 1), got {self.clip_low}"),
            (self.clip_high >= self.clip_low,
             f"trainer.clip_high must be >= clip_low ({self.clip_low}), got {self.clip_high}"),
            (self.is_cap >= 1, f"trainer.is_cap must be >= 1, got {self.is_cap}"),
            (self.grad_clip > 0, f"trainer.grad_clip must be > 0, got {self.grad_clip}"),
            (self.max_tokens_per_micro_batch >= 1, "trainer.max_tokens_per_micro_batch must be "
             f">= 1, got {self.max_tokens_per_micro_batch}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)


def add_metrics(total: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> None:
    """Fold one micro-batch's `policy_loss` metrics into `total` (sum, or max for MAX_METRICS)."""
    for key, value in new.items():
        if key not in total:
            total[key] = value
        elif key in MAX_METRICS:
            total[key] = torch.maximum(total[key], value)
        else:
            total[key] = total[key] + value


class Learner:
    """The policy being trained, sharded over all ranks of the default process group."""

    def __init__(self, model_dir: str | Path, config: LearnerConfig = LearnerConfig(), *,
                 lora: LoraSettings | None = LoraSettings()):
        self.config = config
        self.device = distributed.init_distributed()
        torch.manual_seed(config.seed)  # same LoRA init on every rank
        model, self.tokenizer = load_policy(model_dir, lora=lora)
        self.model = apply_fsdp(model.to(self.device))
        for module in self.model.modules():  # the loss is already a global mean: sum over ranks
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, betas=config.betas,
                                           eps=config.adam_eps, weight_decay=config.weight_decay)
        pad_id = self.tokenizer.pad_token_id
        self.pad_id = int(pad_id if pad_id is not None else 0)
        self.policy_version = 0

    def score(self, batch: MicroBatch) -> torch.Tensor:
        """Logprobs of the targets of `batch` under its sampling setting (floored), [B, L-1].
        A forward of the sharded model: every rank must call it the same number of times."""
        out = self.model(input_ids=batch.input_ids.to(self.device),
                         attention_mask=batch.attention_mask.to(self.device),
                         position_ids=batch.position_ids.to(self.device), use_cache=False)
        s = batch.sampling
        logp = sampled_logprobs(out.logits[:, :-1], batch.targets.to(self.device),
                                temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)
        return logp.clamp(min=LOGPROB_FLOOR)  # [B, L-1]

    def micro_batches(self, groups: list[TrajectoryGroup]) -> list[MicroBatch]:
        """This rank's micro-batches of `groups`, padded with idle ones to the max over ranks."""
        mine = groups[distributed.rank()::distributed.world_size()]
        batches = make_micro_batches(mine, max_tokens=self.config.max_tokens_per_micro_batch,
                                     pad_id=self.pad_id,
                                     scale_by_std=self.config.scale_advantages_by_std)
        most = int(distributed.all_reduce_max(torch.tensor([len(batches)]))[0])
        return batches + [idle_micro_batch(pad_id=self.pad_id)] * (most - len(batches))

    def train_step(self, groups: list[TrajectoryGroup]) -> dict[str, float]:
        """One optimizer step on `groups` (the same list on every rank); returns the metrics."""
        if not groups:
            raise MilesError("train_step needs at least one trajectory group")
        batches = self.micro_batches(groups)
        counts = torch.tensor([float(sum(b.num_tokens for b in batches)),
                               float(sum(b.rewards.sum() for b in batches)),
                               float(sum(len(b.sample_ids) for b in batches))],
                              dtype=torch.float64)
        tokens, reward_sum, samples = distributed.all_reduce_sum(counts).tolist()

        self.model.train()
        sums: dict[str, torch.Tensor] = {}
        for batch in batches:
            add_metrics(sums, self._accumulate(batch, normaliser=tokens))
        grad_norm = self._step()
        return self._reduce(sums, grad_norm=grad_norm, tokens=tokens,
                            reward_mean=reward_sum / samples)

    def _accumulate(self, batch: MicroBatch, *, normaliser: float) -> dict[str, torch.Tensor]:
        logp = self.score(batch)  # [B, L-1]
        proximal_logp = logp.detach()  # one update per step: proximal == current weights
        c = self.config
        loss, metrics = policy_loss(
            logp, proximal_logp, batch.behaviour_logprobs.to(self.device),
            batch.advantages.to(self.device).unsqueeze(1), batch.response_mask.to(self.device),
            normaliser=normaliser, clip_low=c.clip_low, clip_high=c.clip_high, is_cap=c.is_cap)
        loss.backward()
        return {key: value.cpu() for key, value in metrics.items()}

    def _step(self) -> float:
        """Clip, step, zero the grads; returns the pre-clip global gradient norm."""
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.config.grad_clip)
        norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        if math.isfinite(norm):
            self.optimizer.step()
            self.policy_version += 1
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def _reduce(self, sums: dict[str, torch.Tensor], *, grad_norm: float, tokens: float,
                reward_mean: float) -> dict[str, float]:
        keys = sorted(k for k in sums if k not in MAX_METRICS)
        total = distributed.all_reduce_sum(torch.stack([sums[k].double() for k in keys]))
        s = dict(zip(keys, total.tolist()))
        weight_max = distributed.all_reduce_max(sums["is_weight_max"].double().reshape(1))
        n = max(s["tokens"], 1.0)
        return {
            "trainer/loss": s["loss_sum"] / n,
            "trainer/clip_frac": s["clipped"] / n,
            "trainer/kl_behaviour": s["kl_behaviour_sum"] / n,
            "trainer/is_weight_mean": s["is_weight_sum"] / n,
            "trainer/is_weight_max": float(weight_max[0]),
            "trainer/is_truncated_frac": s["is_truncated"] / n,
            "trainer/mismatch": s["mismatch_sum"] / n,
            "trainer/grad_norm": grad_norm,
            "trainer/tokens": tokens,
            "trainer/reward_mean": reward_mean,
            "trainer/skipped_step": float(not math.isfinite(grad_norm)),
            "trainer/policy_version": float(self.policy_version),
        }

    def state_dict(self) -> dict:
        """Trainable weights (sharded DTensors for `torch.distributed.checkpoint`), optimizer
        state, RNG and `policy_version`. A collective. Tensors alias the live state: save or
        copy them before the next `train_step`. Before the first step, torch's helper
        materialises the optimizer state with a zero-lr step (Adam `step` = 1): call it then
        only to load a checkpoint into it."""
        names = trainable_names(self.model)
        weights = get_model_state_dict(self.model,
                                       options=StateDictOptions(ignore_frozen_params=True))
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        return {"model": {k: v for k, v in weights.items() if k in names},
                "optimizer": get_optimizer_state_dict(self.model, self.optimizer),
                "rng": rng, "policy_version": self.policy_version}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned (possibly after a checkpoint round trip)."""
        set_model_state_dict(self.model, state["model"],
                             options=StateDictOptions(strict=False))
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
        torch.set_rng_state(state["rng"]["cpu"])
        if "cuda" in state["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["rng"]["cuda"])
        self.policy_version = int(state["policy_version"])

    def export_adapter(self, out_dir: str | Path) -> Path | None:
        """Write the LoRA adapter in peft's format (rank 0 writes; every rank must call)."""
        return export_adapter(self.model, out_dir)
