"""The learner: one FSDP2-sharded policy (LoRA by default), its optimizer, and the train step.

`train_step(groups)`: every rank receives the same list of groups. It (a) computes outcome
advantages over the whole batch (`AlgorithmConfig.estimator`, after reward shaping), (b) splits
the groups into `mini_batches` slices, (c) before any update scores what the update needs
without grad: proximal logprobs (only with several slices; with one, the proximal policy *is*
the current one and its logprobs are the detached training logprobs), reference logprobs (KL
term), and the critic's values, from which GAE advantages are computed and whitened over the
global batch, (d) per slice, trains on this rank's share of the groups (`slice[rank::world]`),
accumulating gradients of the loss normalised over the whole slice on all ranks, clips the
gradient norm and steps. A `train_step` that updated the actor increments `policy_version`.

Under LoRA the reference policy is the base with the adapter disabled and the critic (PPO) is a
second adapter plus a value head on the same base (`miles.trainer.critic`); under full
fine-tuning the reference is a frozen copy and the critic a separate value model. The actor's
and the critic's losses are backpropagated one after the other, so only one graph is alive.

Simplifications:
- Gradients are reduce-scattered after every micro-batch (FSDP2's default), not only after the
  last: simple and memory-lean; LoRA gradients are small.
- A rank with fewer micro-batches runs idle ones (no response token) so every rank makes the
  same FSDP collectives.
- A step is all or nothing (`train_step`): one whose loss or gradient norm is not finite, or
  that raises on its data, changes nothing and raises `StepError` on every rank; the caller
  isolates the groups that cause it (`miles.trainer.isolation`). An error raised in a forward or
  backward on some ranks only cannot be agreed on (the others wait in a collective): several
  ranks isolate non-finite steps and batching errors; up-front validation keeps the rest out.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from miles.errors import ConfigError, FencedError, MilesError, StepError
from miles.protocol import TrajectoryGroup
from miles.rl.advantages import gae_advantages, token_rewards
from miles.rl.aggregation import Normalisers, aggregate_token_mean
from miles.rl.algorithm import AlgorithmConfig
from miles.rl.kl import entropy_from_logits, kl_estimate
from miles.rl.losses import MAX_METRICS, clipped_value_loss, compute_policy_loss
from miles.rl.sampling import process_logits
from miles.trainer import critic, distributed
from miles.trainer.kl_penalty import KLPenalty
from miles.trainer.batching import (MicroBatch, idle_micro_batch, make_micro_batches,
                                    max_new_tokens, outcome_advantages)
from miles.trainer.model import (PRECISIONS, LoraSettings, apply_fsdp, compute_dtype,
                                 enable_activation_checkpointing, export_adapter, export_full,
                                 fsdp_policies, load_policy, materialise_sharded,
                                 packing_supported, trainable_names)
from miles.trainer.snapshot import Snapshot

log = logging.getLogger(__name__)

LOGPROB_FLOOR = -100.0
"""Trainer logprobs are floored here: a sampled token the trainer's top-k/top-p filter removes
(logprob -inf, engine/trainer mismatch at the filter edge) gets a tiny importance weight and no
gradient instead of a nan from -inf - -inf."""

DATA_ERRORS = (MilesError, ArithmeticError, IndexError, ValueError)
"""What a step raises because of its groups (a sampling setting it cannot re-score, an id past
the embedding, an overflow): the step fails with `StepError` and its groups can be isolated.
Anything else (TypeError, AttributeError, torch's RuntimeError, out of memory) is a bug or the
machine and propagates unchanged. `ConfigError` and `FencedError` always propagate."""
LOSS_SUMS = ("loss_sum", "value_loss_sum")  # the metrics whose non-finiteness fails a step


def finite_losses(sums: dict[str, torch.Tensor]) -> bool:
    """This rank's accumulated policy and value losses are finite."""
    return all(bool(torch.isfinite(sums[k]).all()) for k in LOSS_SUMS if k in sums)


@dataclass(frozen=True, kw_only=True)
class LearnerConfig:
    """Optimizer settings of the learner and the algorithm it runs."""

    lr: float = 1e-4  # AdamW learning rate (LoRA tolerates ~10x the full fine-tuning rate)
    critic_lr: float = 0.0  # learning rate of the critic adapter and value head (0: lr)
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW moment decay rates
    adam_eps: float = 1e-8  # AdamW denominator epsilon
    grad_clip: float = 1.0  # max global gradient norm (inf disables clipping)
    max_tokens_per_micro_batch: int = 8192  # tokens per forward: model rows x longest row
    sequence_packing: bool = True  # several samples per model row, as long as the longest (little
    # compute on padding); false, or a model that ignores restarting position_ids: one each
    seed: int = 0  # seeds the LoRA init (identical on every rank) and torch's RNG
    activation_checkpointing: bool = False  # recompute block activations in backward (memory)
    compile: bool = False  # torch.compile each decoder block of the trained model(s)
    sharded_load: bool = False  # build on the meta device, read only this rank's weight slices
    precision: str = "auto"  # compute dtype: auto (bf16 on CUDA, fp32 on CPU), bf16 or fp32;
    # trained weights, gradient reduction and optimizer state stay fp32, frozen weights (LoRA's
    # base, the reference copy) are stored in the compute dtype
    cpu_offload: bool = False  # keep sharded weights, grads and optimizer state in host memory
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)  # estimator, loss, ...

    def __post_init__(self) -> None:
        checks = [
            (self.lr > 0, f"lr must be > 0, got {self.lr}"),
            (self.critic_lr >= 0, f"critic_lr must be >= 0, got {self.critic_lr}"),
            (self.weight_decay >= 0,
             f"weight_decay must be >= 0, got {self.weight_decay}"),
            (len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
             f"betas must be two values in [0, 1), got {self.betas}"),
            (self.adam_eps > 0, f"adam_eps must be > 0, got {self.adam_eps}"),
            (self.grad_clip > 0, f"grad_clip must be > 0, got {self.grad_clip}"),
            (self.max_tokens_per_micro_batch >= 1, "trainer.max_tokens_per_micro_batch must be "
             f">= 1, got {self.max_tokens_per_micro_batch}"),
            (self.precision in PRECISIONS,
             f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)


def add_metrics(total: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> None:
    """Fold one micro-batch's metrics into `total` (sum, or max for MAX_METRICS)."""
    for key, value in new.items():
        if key not in total:
            total[key] = value
        elif key in MAX_METRICS:
            total[key] = torch.maximum(total[key], value)
        else:
            total[key] = total[key] + value


@dataclass
class Prepared:
    """What one micro-batch's update needs, scored before any update of the step ([B, L-1])."""

    proximal: torch.Tensor | None = None  # proximal logprobs (None: the detached current ones)
    reference: torch.Tensor | None = None  # reference logprobs (KL term)
    old_values: torch.Tensor | None = None  # critic values before the update
    advantages: torch.Tensor | None = None  # per-token GAE advantages (whitened)
    returns: torch.Tensor | None = None  # GAE returns (value targets)


def split_evenly(items: list, parts: int) -> list[list]:
    """`items` cut into at most `parts` contiguous, non-empty slices of near-equal size."""
    parts = min(parts, len(items))
    bounds = [round(i * len(items) / parts) for i in range(parts + 1)]
    return [items[a:b] for a, b in zip(bounds, bounds[1:])]


class Learner:
    """The policy being trained (and its critic and reference when the algorithm needs them),
    sharded over all ranks of the default process group."""

    def __init__(self, model_dir: str | Path, config: LearnerConfig = LearnerConfig(), *,
                 lora: LoraSettings | None = LoraSettings()):
        self.config = config
        self.algorithm = config.algorithm
        self.device = distributed.init_distributed()
        torch.manual_seed(config.seed)  # same LoRA init on every rank
        meta = config.sharded_load
        if meta and self.algorithm.uses_critic and lora is None:
            raise ConfigError("learner.sharded_load with a full-parameter critic is not "
                              "implemented; use LoRA or sharded_load=false")
        self.dtype = compute_dtype(config.precision, self.device)
        policies = fsdp_policies(self.dtype, cpu_offload=config.cpu_offload, device=self.device)
        shard = {"compile_blocks": config.compile, "policies": policies}
        frozen = self.dtype  # what weights nobody trains are stored in: the compute dtype
        model, self.tokenizer = load_policy(model_dir, lora=lora, meta=meta,
                                            dtype=torch.float32 if lora is None else frozen)
        if config.activation_checkpointing:
            enable_activation_checkpointing(model)
        self.critic = None  # full fine-tuning's value model (LoRA: an adapter of self.model)
        if self.algorithm.uses_critic and lora is not None:
            critic.add_critic(model, lora)
            self.model = critic.apply_fsdp_with_head(self._placed(model), **shard)
        else:
            self.model = apply_fsdp(self._placed(model), **shard)
        if meta:
            materialise_sharded(self.model, model_dir, self.device, cpu_offload=config.cpu_offload)
            if self.algorithm.uses_critic:
                critic.init_value_head(critic.value_head(self.model))
        if self.algorithm.uses_critic and lora is None:
            value_model = critic.ValueModel(load_policy(model_dir, lora=None)[0])
            if config.activation_checkpointing:
                enable_activation_checkpointing(value_model)
            self.critic = critic.apply_fsdp_with_head(value_model.to(self.device), **shard)
        # what the optimizer and checkpoints hold: the policy, and a separate critic if any
        self.trained = self.model if self.critic is None else \
            torch.nn.ModuleDict({"actor": self.model, critic.CRITIC: self.critic})
        self.reference = None  # full fine-tuning: a frozen copy; LoRA: the disabled adapter
        if self.algorithm.uses_reference and lora is None:
            reference = load_policy(model_dir, lora=None, meta=meta, dtype=frozen)[0]
            self.reference = apply_fsdp(self._placed(reference), policies=policies)
            if meta:
                materialise_sharded(self.reference, model_dir, self.device,
                                    cpu_offload=config.cpu_offload)
            self.reference.requires_grad_(False)
        for module in self.trained.modules():  # the loss is already a global mean: sum over ranks
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
        self.params = [p for p in self.trained.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self._param_groups(), lr=config.lr,
                                           betas=config.betas, eps=config.adam_eps,
                                           weight_decay=config.weight_decay)
        pad_id = self.tokenizer.pad_token_id
        self.pad_id = int(pad_id if pad_id is not None else 0)
        self.packing = config.sequence_packing and packing_supported(self.model, self.device)
        if config.sequence_packing and not self.packing:
            log.warning("%s ignores restarting position_ids (packed sequences would attend to "
                        "each other): micro-batches are padded instead",
                        self.model.config.model_type)
        self.policy_version = 0
        self.steps = 0  # train_step calls, critic warm-up included
        self.kl = KLPenalty(self.algorithm)  # the KL coefficient (fixed or adaptive)

    def _placed(self, model: torch.nn.Module) -> torch.nn.Module:
        """`model` on this rank's device, unless it is still on the meta device (sharded load:
        `materialise_sharded` allocates it after sharding)."""
        return model if self.config.sharded_load else model.to(self.device)

    def _param_groups(self) -> list[dict]:
        if not self.algorithm.uses_critic:
            return [{"params": self.params}]
        names = dict(self.trained.named_parameters())
        critic_names = {n for n in names if critic.is_critic_parameter(n)}
        actor = [p for n, p in names.items() if p.requires_grad and n not in critic_names]
        value = [p for n, p in names.items() if p.requires_grad and n in critic_names]
        return [{"params": actor},
                {"params": value, "lr": self.config.critic_lr or self.config.lr}]

    # -- scoring ------------------------------------------------------------------------------

    def _inputs(self, batch: MicroBatch) -> tuple:
        """(input_ids, attention_mask or None, position_ids) of `batch` on this rank's device."""
        mask = batch.attention_mask
        return (batch.input_ids.to(self.device), None if mask is None else mask.to(self.device),
                batch.position_ids.to(self.device))

    def _forward(self, model, batch: MicroBatch):
        input_ids, attention_mask, position_ids = self._inputs(batch)
        return model(input_ids=input_ids, attention_mask=attention_mask,
                     position_ids=position_ids, use_cache=False)

    def _processed(self, logits: torch.Tensor, batch: MicroBatch) -> torch.Tensor:
        """Logits of the distribution each target was sampled from, [R, T-1, V] (model
        layout: `batch.unpack` turns per-prediction values into per-sample rows)."""
        s = batch.sampling
        return process_logits(logits[:, :-1].float(), temperature=s.temperature, top_k=s.top_k,
                              top_p=s.top_p)  # fp32 even when the model computes in bf16

    def _gather(self, processed: torch.Tensor, batch: MicroBatch) -> torch.Tensor:
        """Floored logprobs of the targets under `processed` logits, [B, L-1]."""
        logp = processed.log_softmax(dim=-1).gather(
            -1, batch.targets.to(self.device).unsqueeze(-1)).squeeze(-1)  # [R, T-1]
        return batch.unpack(logp.clamp(min=LOGPROB_FLOOR))

    def score(self, batch: MicroBatch) -> torch.Tensor:
        """Logprobs of the targets of `batch` under the policy (floored), [B, L-1]. A forward
        of the sharded model: every rank must call it the same number of times."""
        return self._gather(self._processed(self._forward(self.model, batch).logits, batch), batch)

    @torch.no_grad()
    def _reference_logprobs(self, batch: MicroBatch) -> torch.Tensor:
        if self.reference is not None:
            logits = self._forward(self.reference, batch).logits
        else:
            with critic.disabled_adapters(self.model):
                logits = self._forward(self.model, batch).logits
        return self._gather(self._processed(logits, batch), batch)

    def _values(self, batch: MicroBatch) -> torch.Tensor:
        """Critic values of the states that predict each target, [B, L-1]."""
        if self.critic is not None:
            values = self.critic(*self._inputs(batch))  # [R, T]
        else:
            values = critic.values(self.model, *self._inputs(batch))  # [R, T]
        return batch.unpack(values[:, :-1].float())

    # -- the step -----------------------------------------------------------------------------

    def micro_batches(self, groups: list[TrajectoryGroup], outcomes=None) -> list[MicroBatch]:
        """This rank's micro-batches of `groups`, padded with idle ones to the max over ranks.
        `outcomes`: (rewards, advantages) of `groups` (default: `outcome_advantages`)."""
        outcomes = outcomes or outcome_advantages(groups, self.algorithm)
        rank, world = distributed.rank(), distributed.world_size()
        mine = (groups[rank::world], outcomes[0][rank::world], outcomes[1][rank::world])
        batches, error = [], None
        try:  # only this rank sees its share: the error is agreed on before anyone raises
            batches = make_micro_batches(
                mine[0], max_tokens=self.config.max_tokens_per_micro_batch, pad_id=self.pad_id,
                algorithm=self.algorithm, outcomes=(mine[1], mine[2]), packed=self.packing)
        except DATA_ERRORS as err:
            error = err
        most, failing = distributed.all_reduce_max(  # failing: 1 + the last failing rank
            torch.tensor([len(batches), rank + 1 if error is not None else 0]))
        if failing:  # every rank raises that rank's reason
            src = int(failing) - 1
            reason = f"{type(error).__name__}: {error}" if rank == src else None
            reason = distributed.broadcast_bytes(reason and reason.encode(), src=src).decode()
            raise StepError(reason) from error
        return batches + [idle_micro_batch(pad_id=self.pad_id)] * (int(most) - len(batches))

    def train_step(self, groups: list[TrajectoryGroup], *, apply: bool = True
                   ) -> dict[str, float]:
        """One step on `groups` (the same list on every rank): `mini_batches` optimizer steps
        (only the critic's during warm-up); returns the metrics. `apply=False` probes: the same
        forwards, backwards and checks, no optimizer step.

        All or nothing: a non-finite loss or gradient norm, or a `DATA_ERRORS` exception, raises
        `StepError` on every rank with the weights, optimizer state and versions as before the
        step (a step of several mini-batches is undone from a `Snapshot`)."""
        if not groups:
            raise MilesError("train_step needs at least one trajectory group")
        several = apply and self.algorithm.mini_batches > 1 and len(groups) > 1
        snapshot = Snapshot(self.params, self.optimizer) if several else None
        try:
            return self._train_step(groups, apply)
        except (ConfigError, FencedError):
            raise
        except DATA_ERRORS as err:
            self.optimizer.zero_grad(set_to_none=True)
            if snapshot is not None:
                snapshot.restore()
            if isinstance(err, StepError):
                raise
            raise StepError(f"{type(err).__name__}: {err}") from err

    def _train_step(self, groups: list[TrajectoryGroup], apply: bool) -> dict[str, float]:
        rewards, advantages = outcome_advantages(groups, self.algorithm)
        indices = split_evenly(list(range(len(groups))), self.algorithm.mini_batches)
        slices = [self.micro_batches([groups[i] for i in part],
                                     ([rewards[i] for i in part], [advantages[i] for i in part]))
                  for part in indices]
        limits = [max(max_new_tokens(groups[i]) for i in part) for part in indices]
        prepared = self._prepare(slices)
        train_actor = self.steps >= self.algorithm.critic_warmup_steps
        self.trained.train()
        sums: dict[str, torch.Tensor] = {}
        norms = []
        for batches, extras, limit in zip(slices, prepared, limits):
            normalisers = self._normalisers(batches, limit)
            for batch, extra in zip(batches, extras):
                add_metrics(sums, self._accumulate(batch, extra, normalisers, train_actor))
            norms.append(self._step(apply, finite_losses(sums)))
        if apply:
            self.steps += 1
            self.policy_version += int(train_actor)
            self.kl.update()
        return {**self._reduce(sums, norms, slices), **self.kl.metrics()}

    def _normalisers(self, batches: list[MicroBatch], limit: int) -> Normalisers:
        """Token and row counts of a slice over all ranks; `limit` is its max_new_tokens."""
        local = torch.tensor([[b.num_tokens, int(b.response_mask.any(dim=-1).sum())]
                              for b in batches], dtype=torch.float64).sum(dim=0)
        tokens, rows = distributed.all_reduce_sum(local).tolist()
        return Normalisers(tokens=tokens, rows=rows, constant=float(limit))

    @torch.no_grad()
    def _prepare(self, slices: list[list[MicroBatch]]) -> list[list[Prepared]]:
        """Everything scored before the first update of the step (see the module docstring)."""
        a = self.algorithm
        out = []
        for batches in slices:
            extras = []
            for batch in batches:
                extra = Prepared()
                if a.mini_batches > 1:
                    extra.proximal = self.score(batch)
                if a.uses_reference:
                    extra.reference = self._reference_logprobs(batch)
                if a.uses_critic:
                    self._prepare_gae(batch, extra)
                extras.append(extra)
            out.append(extras)
        self.kl.prepare([b for s in slices for b in s], [e for extras in out for e in extras])
        if a.uses_critic:
            self._whiten([e for extras in out for e in extras], slices)
        return out

    def _prepare_gae(self, batch: MicroBatch, extra: Prepared) -> None:
        a = self.algorithm
        mask = batch.response_mask.to(self.device)  # [B, L-1]
        extra.old_values = self._values(batch)  # [B, L-1]
        penalty = None
        if a.kl_in_reward:  # InstructGPT: k1 KL of the sampling policy to the reference
            penalty = kl_estimate(batch.behaviour_logprobs.to(self.device), extra.reference,
                                  "k1")
        rewards = token_rewards(batch.rewards.to(self.device), mask, penalty, self.kl.coef)
        extra.advantages, extra.returns = gae_advantages(rewards, extra.old_values, mask,
                                                         gamma=a.gamma, lam=a.lam)

    def _whiten(self, extras: list[Prepared], slices: list[list[MicroBatch]]) -> None:
        """GAE advantages normalised by their mean and std over the global batch."""
        masks = [b.response_mask.to(self.device) for batches in slices for b in batches]
        stats = torch.zeros(3, dtype=torch.float64)
        for extra, mask in zip(extras, masks):
            values = extra.advantages[mask].double()
            stats += torch.stack([values.sum(), (values ** 2).sum(),
                                  torch.tensor(float(values.numel()), dtype=torch.float64)]).cpu()
        total, squares, count = distributed.all_reduce_sum(stats).tolist()
        mean = total / max(count, 1.0)
        std = math.sqrt(max(squares / max(count, 1.0) - mean ** 2, 0.0))
        for extra, mask in zip(extras, masks):
            extra.advantages = torch.where(mask, (extra.advantages - mean) / (std + 1e-8), 0.0)

    def _accumulate(self, batch: MicroBatch, extra: Prepared, normalisers: Normalisers,
                    train_actor: bool) -> dict[str, torch.Tensor]:
        """Backpropagate the actor's loss, then the critic's (one graph alive at a time)."""
        mask = batch.response_mask.to(self.device)  # [B, L-1]
        metrics: dict[str, torch.Tensor] = {}
        if train_actor:
            loss, metrics = self._policy_loss(batch, extra, normalisers, mask)
            loss.backward()
        if self.algorithm.uses_critic:
            value_loss, value_metrics = self._value_loss(batch, extra, normalisers, mask)
            (self.algorithm.value_coef * value_loss).backward()
            metrics.update(value_metrics)
        return {key: value.cpu() for key, value in metrics.items()}

    def _policy_loss(self, batch: MicroBatch, extra: Prepared, normalisers: Normalisers,
                     mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        settings = self.kl.loss_settings()  # no KL term when it is in the reward
        processed = self._processed(self._forward(self.model, batch).logits, batch)
        logp = self._gather(processed, batch)  # [B, L-1]
        entropy = batch.unpack(entropy_from_logits(  # [B, L-1]
            processed if settings.entropy_coef else processed.detach()))  # 0: measured only
        proximal = extra.proximal if extra.proximal is not None else logp.detach()
        advantages = extra.advantages if extra.advantages is not None else \
            batch.advantages.to(self.device).unsqueeze(1)  # [B, L-1] or [B, 1]
        return compute_policy_loss(
            logp, proximal, batch.behaviour_logprobs.to(self.device), advantages, mask,
            normalisers=normalisers, settings=settings, ref_logp=extra.reference,
            entropy=entropy)

    def _value_loss(self, batch: MicroBatch, extra: Prepared, normalisers: Normalisers,
                    mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        new_values = self._values(batch)  # [B, L-1]
        per_token, clipped = clipped_value_loss(new_values, extra.old_values, extra.returns,
                                                clip=self.algorithm.value_clip)
        loss = aggregate_token_mean(per_token, mask, normalisers)

        def masked_sum(values: torch.Tensor) -> torch.Tensor:
            return torch.where(mask, values.detach().float(), 0.0).sum()

        return loss, {"value_tokens": mask.sum().float(),
                      "value_loss_sum": masked_sum(per_token),
                      "value_clipped": masked_sum(clipped),
                      "value_sum": masked_sum(new_values),
                      "return_sum": masked_sum(extra.returns)}

    def _step(self, apply: bool, losses_finite: bool) -> float:
        """Clip, step (unless probing), zero the grads; returns the pre-clip global gradient
        norm. A non-finite norm, or a non-finite loss on any rank, raises `StepError` on every
        rank before the optimizer steps."""
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.config.grad_clip)
        norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        losses_bad = distributed.any_rank(not losses_finite)
        if losses_bad or not math.isfinite(norm):  # the same verdict and text on every rank
            raise StepError(f"step non-finite: grad_norm={norm}"
                            + (", loss not finite" if losses_bad else ""))
        if apply:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def _reduce(self, sums: dict[str, torch.Tensor], norms: list[float],
                slices: list[list[MicroBatch]]) -> dict[str, float]:
        batches = [b for batches in slices for b in batches]
        counts = torch.tensor([float(sum(b.rewards.sum() for b in batches)),
                               float(sum(len(b.sample_ids) for b in batches)),
                               float(sum(b.num_tokens for b in batches))], dtype=torch.float64)
        reward_sum, samples, tokens = distributed.all_reduce_sum(counts).tolist()
        keys = sorted(k for k in sums if k not in MAX_METRICS)
        s = dict(zip(keys, distributed.all_reduce_sum(
            torch.stack([sums[k].double() for k in keys])).tolist())) if keys else {}
        out = {"trainer/grad_norm": max(norms), "trainer/tokens": tokens,
               "trainer/reward_mean": reward_sum / max(samples, 1.0),
               "trainer/policy_version": float(self.policy_version)}
        if "tokens" in s:
            out.update(policy_metrics(s, sums))
        if "value_tokens" in s:
            n = max(s["value_tokens"], 1.0)
            out.update({"trainer/value_loss": s["value_loss_sum"] / n,
                        "trainer/value_clip_frac": s["value_clipped"] / n,
                        "trainer/value_mean": s["value_sum"] / n,
                        "trainer/return_mean": s["return_sum"] / n})
        return out

    def state_dict(self) -> dict:
        """Trainable weights (sharded DTensors for `torch.distributed.checkpoint`), optimizer
        state, RNG and `policy_version`. A collective. Tensors alias the live state: save or
        copy them before the next `train_step`. Before the first step, torch's helper
        materialises the optimizer state with a zero-lr step (Adam `step` = 1): call it then
        only to load a checkpoint into it."""
        names = trainable_names(self.trained)
        weights = get_model_state_dict(self.trained,
                                       options=StateDictOptions(ignore_frozen_params=True))
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        return {"model": {k: v for k, v in weights.items() if k in names},
                "optimizer": get_optimizer_state_dict(self.trained, self.optimizer),
                "rng": rng, "policy_version": self.policy_version, "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned (possibly after a checkpoint round trip)."""
        set_model_state_dict(self.trained, state["model"],
                             options=StateDictOptions(strict=False))
        set_optimizer_state_dict(self.trained, self.optimizer, state["optimizer"])
        torch.set_rng_state(state["rng"]["cpu"])
        if "cuda" in state["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["rng"]["cuda"])
        self.policy_version = int(state["policy_version"])
        self.steps = int(state.get("steps", self.policy_version))

    @property
    def weights_format(self) -> str:
        """What `export_weights` writes: "lora" (the adapter) or "full" (the whole policy)."""
        return "lora" if hasattr(self.model, "peft_config") else "full"

    def export_weights(self, out_dir: str | Path) -> Path | None:
        """Write the policy for the engines: the LoRA adapter in peft's format, or the full
        model (rank 0 writes; every rank must call)."""
        if self.weights_format == "lora":
            return export_adapter(self.model, out_dir)
        return export_full(self.model, out_dir)


def policy_metrics(s: dict[str, float], sums: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per-token means of the summed `compute_policy_loss` metrics `s` (over all ranks)."""
    n = max(s["tokens"], 1.0)
    weight_max = distributed.all_reduce_max(sums["is_weight_max"].double().reshape(1))
    out = {
        "trainer/loss": s["loss_sum"] / n,
        "trainer/clip_frac": s["clipped"] / n,
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
