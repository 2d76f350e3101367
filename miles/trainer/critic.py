"""The critic (PPO's value function): under LoRA, actor, critic and reference on one copy of
the base model; under full fine-tuning, a separate value model.

The policy from `load_policy` (one peft LoRA adapter, the actor) gains a second adapter, the
critic, and a value head `Linear(hidden, 1)` registered on the peft model as `value_head`. The
reference policy is the same base with every adapter disabled. One base copy serves all three;
one optimizer updates both adapters and the head.

This module owns: adding the critic (`add_critic`), sharding the three with FSDP2
(`apply_fsdp_with_head`), choosing what a forward runs (`use_adapter`, `disabled_adapters`),
and the two forwards that are not the policy's (`values`, `reference_logits`).

Why it looks like this (peft 0.21):
- Adapters are switched with peft's public `set_adapter` / `disable_adapter`. Both also rewrite
  `requires_grad` (only the active adapter stays trainable, and leaving `disable_adapter` keeps
  only the active one trainable), which would silently stop the critic from learning and drop
  it from anything keyed on `requires_grad` (checkpoints, `trainable_names`). Every switch here
  restores the flags it found, so the trainable set never changes. FSDP2 copies the sharded
  parameter's `requires_grad` onto the unsharded one at every all-gather, so the flags are
  tolerated, but they are restored anyway. peft's per-row `adapter_names=` forward argument is
  refused in training mode, so it cannot select the adapter of a training forward.
- The value head is its own FSDP2 unit: `values` calls it after the root forward returned, and
  its own pre-forward hook all-gathers it there (a head inside the root unit would be read while
  the root may already be resharded).
- `values` runs the full causal LM with `output_hidden_states=True` and `logits_to_keep=1`: the
  root FSDP unit (final norm, tied embeddings) is only gathered by the root's forward, so the inner
  decoder cannot be called alone; `logits_to_keep=1` keeps the LM head to one position.
- The actor is peft's "default" adapter (`model.ADAPTER_NAME`), so `export_adapter` and the
  engines' hot-load keep working unchanged; the critic is never exported to the engines.
- The value head is fp32 like every stored weight; under bf16 mixed precision it computes in
  bf16 like the rest, and the learner reads values in fp32.

Full fine-tuning has no adapter to switch: the critic is `ValueModel`, its own full copy of the
checkpoint plus a value head, sharded like the policy (`apply_fsdp_with_head`) and trained by
the same optimizer.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

from miles.errors import ConfigError
from miles.trainer.model import ADAPTER_NAME, LoraSettings, apply_fsdp

ACTOR = ADAPTER_NAME  # the policy adapter, exported to the engines
CRITIC = "critic"  # the value adapter, trained with the value head
VALUE_HEAD = "value_head"  # attribute of the peft model holding the Linear(hidden, 1)


def add_critic(model: nn.Module, lora: LoraSettings) -> nn.Linear:
    """Add the critic adapter (shape `lora`) and the value head to the peft `model` of
    `load_policy`, before `apply_fsdp_with_head`. Both adapters and the head are trainable;
    the actor stays the active adapter. The LoRA and head inits draw from torch's global RNG:
    seed it first, identically on every rank. Returns the head."""
    from miles.engines.hf import lora_config  # the adapter is built as the engines build it

    if not hasattr(model, "peft_config"):
        raise ConfigError("add_critic needs a LoRA (peft) policy; load it with `lora` set")
    flags = requires_grad_flags(model)
    model.add_adapter(CRITIC, lora_config(lora))
    restore_requires_grad(flags)
    model.set_requires_grad(CRITIC, True)  # peft leaves a new, inactive adapter frozen
    head = new_value_head(model)
    model.add_module(VALUE_HEAD, head)
    return head


def new_value_head(model: nn.Module) -> nn.Linear:
    """`Linear(hidden, 1)` on `model`'s device, fp32 (trainable, whatever the frozen base is
    stored in); small init: values start near 0 but give the critic's body a gradient. Draws
    from torch's global RNG."""
    embeddings = model.get_input_embeddings().weight  # [V, H]
    head = nn.Linear(embeddings.shape[1], 1, device=embeddings.device, dtype=torch.float32)
    if head.weight.device.type != "meta":  # a meta head is initialised once materialised
        init_value_head(head)
    return head


@torch.no_grad()
def init_value_head(head: nn.Linear) -> None:
    """Weights ~ N(0, 1 / (hidden + 1)), bias 0 (also for a sharded head: DTensor ops)."""
    head.weight.normal_(std=1.0 / math.sqrt(head.in_features + 1))
    head.bias.zero_()


def apply_fsdp_with_head(model: nn.Module, mesh=None, *, compile_blocks: bool = False,
                         policies: dict | None = None) -> nn.Module:
    """`apply_fsdp` with the value head as one more FSDP2 unit (sharded before the root), for
    a policy with a critic adapter and for a `ValueModel`."""
    fully_shard(value_head(model), mesh=mesh, **(policies or {}))
    return apply_fsdp(model, mesh=mesh, compile_blocks=compile_blocks, policies=policies)


def value_head(model: nn.Module) -> nn.Module:
    head = getattr(model, VALUE_HEAD, None)
    if head is None:
        raise ConfigError("the policy has no value head; call add_critic first")
    return head


def requires_grad_flags(model: nn.Module) -> list[tuple[nn.Parameter, bool]]:
    """Every parameter with its `requires_grad`, for `restore_requires_grad`."""
    return [(param, param.requires_grad) for param in model.parameters()]


def restore_requires_grad(flags: list[tuple[nn.Parameter, bool]]) -> None:
    """Undo what peft's adapter switches did to `requires_grad`."""
    for param, flag in flags:
        if param.requires_grad != flag:
            param.requires_grad_(flag)


@contextmanager
def use_adapter(model: nn.Module, name: str) -> Iterator[nn.Module]:
    """Forwards inside run adapter `name` (ACTOR or CRITIC); the previous one is active again on
    exit. Trainability is untouched. Enter and leave it on every rank alike (it changes what the
    FSDP units compute, not which collectives run)."""
    if name not in model.peft_config:
        raise ConfigError(f"unknown adapter {name!r}; the model has {sorted(model.peft_config)}")
    previous, flags = model.active_adapter, requires_grad_flags(model)
    model.set_adapter(name)
    restore_requires_grad(flags)
    try:
        yield model
    finally:
        model.set_adapter(previous)
        restore_requires_grad(flags)


@contextmanager
def disabled_adapters(model: nn.Module) -> Iterator[nn.Module]:
    """Forwards inside run the base model (the reference policy); trainability is untouched."""
    flags = requires_grad_flags(model)
    try:
        with model.disable_adapter():
            restore_requires_grad(flags)
            yield model
    finally:
        restore_requires_grad(flags)


def values(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
           position_ids: torch.Tensor) -> torch.Tensor:
    """Critic value of every position, [B, L]: the last hidden state (after the final norm) of
    the critic-adapted base, through the value head. Differentiable; a collective under FSDP2."""
    with use_adapter(model, CRITIC):
        out = model(input_ids=input_ids, attention_mask=attention_mask,
                    position_ids=position_ids, use_cache=False, output_hidden_states=True,
                    logits_to_keep=1)
    hidden = out.hidden_states[-1]  # [B, L, H]
    return value_head(model)(hidden).squeeze(-1)  # [B, L]


@torch.no_grad()
def reference_logits(model: nn.Module, input_ids: torch.Tensor,
                     attention_mask: torch.Tensor | None, position_ids: torch.Tensor
                     ) -> torch.Tensor:
    """Logits of the reference policy (the base, adapters disabled), [B, L, V], no graph."""
    with disabled_adapters(model):
        out = model(input_ids=input_ids, attention_mask=attention_mask,
                    position_ids=position_ids, use_cache=False)
    return out.logits  # [B, L, V]


class ValueModel(nn.Module):
    """A full-parameter critic: a causal LM checkpoint whose last hidden state (after the final
    norm) goes through a value head `Linear(hidden, 1)`."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm
        setattr(self, VALUE_HEAD, new_value_head(lm))

    def get_base_model(self) -> nn.Module:
        """The causal LM (as peft models answer it), where `decoder_layers` finds the blocks."""
        return self.lm

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                position_ids: torch.Tensor) -> torch.Tensor:
        """Value of every position, [B, L]."""
        out = self.lm(input_ids=input_ids, attention_mask=attention_mask,
                      position_ids=position_ids, use_cache=False, output_hidden_states=True,
                      logits_to_keep=1)
        values = value_head(self)(out.hidden_states[-1]).squeeze(-1)  # [B, L]
        return values.clone()  # not a view: FSDP2 hooks the root's output for backward


def is_critic_parameter(name: str) -> bool:
    """Whether the parameter called `name` is the critic's (its adapter, the value head, or
    anything under a module called `critic`, as in the learner's full fine-tuning container)."""
    parts = name.split(".")
    return CRITIC in parts or VALUE_HEAD in parts
