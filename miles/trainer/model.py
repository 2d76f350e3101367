"""The policy model: load a Hugging Face causal LM (+ a LoRA adapter via peft), shard it with
FSDP2, and export the adapter in peft's own format for the engines to hot-load.

This is the trainer's only importer of `transformers` and `peft`, besides
`miles.trainer.attention` (the learner's attention function, which `load_policy` gives every model
it loads) and the learner process's tokenizer. `LoraSettings` and the peft config built from it
are the engines' (`miles.engines`), so trainer and engines agree on the adapter's shape.

Simplifications:
- By default the model is materialised in full on every rank and then sharded (`fully_shard`
  keeps each rank's shard); `load_policy(meta=True)` + `materialise_sharded` build it on the
  meta device and read only each rank's slices (`learner.sharded_load`).
- Trained parameters are loaded and kept (sharded, with the optimizer state) in fp32; bf16 is
  the compute dtype, through FSDP2's mixed-precision policy (`fsdp_policies`). Frozen weights
  (LoRA's base, a reference copy) are loaded in the compute dtype: nothing updates them, so an
  fp32 copy would only double their memory.
- One policy adapter named "default" (the PPO critic adds its own, `miles.trainer.critic`).
- Full weights are exported as one `model.safetensors` (no shards): the weight store announces
  one file per version.
- Decoder blocks are found at `<causal lm>.model.layers` (Llama, Qwen2, Mistral, Gemma, ...);
  other layouts raise `ConfigError`.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy,
                                    fully_shard)
from torch.distributed.tensor import DTensor

from miles.engines.base import LoraSettings  # shared with the engines: one adapter shape
from miles.errors import ConfigError, MilesError
from miles.trainer import distributed
from miles.trainer.batching import visibility

log = logging.getLogger(__name__)

ADAPTER_NAME = "default"
PRECISIONS = ("auto", "fp32", "bf16")
"""learner.precision: "bf16" computes in bf16 (fp32 master weights and gradient reduction),
"fp32" in fp32, "auto" in bf16 on CUDA and on CPUs where bf16 is faster and close enough
(`miles.trainer.precision`), fp32 elsewhere. Frozen weights are stored in the compute dtype."""


def fsdp_policies(dtype: torch.dtype, *, cpu_offload: bool, device: torch.device) -> dict:
    """`fully_shard` keyword arguments: bf16 compute (parameters all-gathered in bf16, gradients
    reduced in fp32 into the fp32 shards) and CPU offload (shards, gradients and optimizer state
    in host memory, copied to the device per unit; the optimizer steps on the CPU)."""
    policies: dict = {}
    if dtype != torch.float32:
        policies["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype,
                                                     reduce_dtype=torch.float32)
    if cpu_offload:
        policies["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    return policies


def load_policy(model_dir: str | Path, *, lora: LoraSettings | None,
                dtype: torch.dtype = torch.float32, meta: bool = False) -> tuple[nn.Module, object]:
    """(model, tokenizer) from `model_dir`; with `lora`, a peft model whose only trainable
    parameters are the adapter's. The adapter init draws from torch's global RNG: seed it first
    (identically on every rank). With `meta`, the model is only built, on the meta device (no
    memory): shard it with `apply_fsdp`, then `materialise_sharded` reads the weights."""
    from peft import get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from miles.engines.hf import lora_config  # the engines build their adapter the same way
    from miles.trainer.attention import ATTENTION  # importing it registers it with transformers

    try:
        if meta:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir),
                                                         dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"trainer.model_dir {str(model_dir)!r} could not be loaded: {exc}"
                          ) from exc
    model.config.use_cache = False
    if model.config._attn_implementation == "sdpa" and model.is_backend_compatible():
        model.set_attn_implementation(ATTENTION)  # the learner's own (`miles.trainer.attention`)
    if lora is not None:
        model = get_peft_model(model, lora_config(lora), adapter_name=ADAPTER_NAME)
        fuse_lora_forwards(model)
    return model, tokenizer


def fuse_lora_forwards(model: nn.Module) -> None:
    """Give each of `model`'s peft LoRA linears the forward of `fused_lora_forward` (the same
    function as peft's, in fewer ops)."""
    from peft.tuners.lora.layer import Linear

    for module in model.modules():
        if type(module) is Linear:
            module.forward = fused_lora_forward.__get__(module)


def fused_lora_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """peft's `lora.Linear.forward` where one plain LoRA adapter is active: `base(x) + s * B(A(x))`
    with `s` applied at the rank's width and the product accumulated into the base output by
    one `addmm`. peft scales and adds at the output's width, in separate ops: in a bf16 step of
    the demo's model those were about an eighth of the time. Any other case (adapters disabled
    or merged, several active, a LoRA variant or bias, mixed dtypes, extra arguments) runs
    peft's own."""
    names = [a for a in self.active_adapters if a in self.lora_A]
    if (args or kwargs or self.disable_adapters or self.merged or len(names) != 1
            or names[0] in self.lora_variant or self.lora_B[names[0]].bias is not None
            or not x.dtype == self.base_layer.weight.dtype == self.lora_A[names[0]].weight.dtype
            == self.lora_B[names[0]].weight.dtype):
        return type(self).forward(self, x, *args, **kwargs)
    name = names[0]
    result = self.base_layer(x)
    low = self.lora_A[name](self.lora_dropout[name](x)) * self.scaling[name]
    # in place: the base output is saved by no backward
    result.view(-1, result.shape[-1]).addmm_(low.view(-1, low.shape[-1]),
                                             self.lora_B[name].weight.t())
    return result


def materialise_sharded(model: nn.Module, model_dir: str | Path, device: torch.device, *,
                        cpu_offload: bool = False) -> None:
    """Give a meta-built, `apply_fsdp`-sharded model (`load_policy(meta=True)`) its weights
    without any rank holding them all: allocate this rank's shards, read exactly those slices
    from the checkpoint's safetensors (`torch.distributed.checkpoint`'s Hugging Face reader),
    then re-create what a checkpoint does not hold: rotary-embedding buffers and a fresh LoRA
    init (DTensor random ops: the same values on every rank, not those of the unsharded path).
    With `cpu_offload` the shards are allocated in host memory. A collective: every rank calls it.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    model.to_empty(device=torch.device("cpu") if cpu_offload else device)
    reader = HuggingFaceStorageReader(str(model_dir))
    stored = reader.read_metadata().state_dict_metadata
    targets = {checkpoint_name(name): param for name, param in model.named_parameters()
               if "lora_" not in name and name.split(".")[0] != "value_head"}
    missing = sorted(set(targets) - set(stored))
    if missing:
        raise ConfigError(f"{model_dir}: the checkpoint has no tensor for {missing[:5]}")
    dcp.load(targets, storage_reader=reader)
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith("RotaryEmbedding"):
                fresh = type(module)(config=module.config).to(device)
                for name, buffer in fresh.named_buffers(recurse=False):
                    setattr(module, name, buffer)
            if hasattr(module, "reset_lora_parameters"):
                for adapter in module.lora_A:
                    module.reset_lora_parameters(adapter, True)


def checkpoint_name(name: str) -> str:
    """The Hugging Face checkpoint key of parameter `name` of a (peft-wrapped) causal LM."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks of a causal LM, through a peft wrapper if there is one."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = getattr(getattr(base, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ConfigError(f"{type(base).__name__} has no decoder blocks at .model.layers; "
                          "FSDP2 sharding does not know this architecture")
    return layers


def apply_fsdp(model: nn.Module, mesh=None, *, compile_blocks: bool = False,
               policies: dict | None = None) -> nn.Module:
    """Shard `model` with FSDP2: one `fully_shard` unit per decoder block, one for the input
    embeddings and one for the LM head (`vocab_units`), then the root (the final norm and
    anything else left). `mesh` None: all ranks of the default group. With `compile_blocks`,
    each decoder block is compiled with `torch.compile` first (the block's forward and its FSDP
    hooks; the first steps pay the compilation). `policies`: more `fully_shard` arguments for
    every unit (`fsdp_policies`)."""
    for layer in decoder_layers(model):
        if compile_blocks:
            layer.compile()
        fully_shard(layer, mesh=mesh, **(policies or {}))
    for unit in vocab_units(model):
        fully_shard(unit, mesh=mesh, **(policies or {}))
    fully_shard(model, mesh=mesh, **(policies or {}))
    return model


def vocab_units(model: nn.Module) -> list[nn.Module]:
    """The [vocab, hidden] matrices that get FSDP2 units of their own: the input embeddings and
    an untied LM head. The root unit is never resharded between its forward and its backward,
    so in it these two (the largest matrices of a small model) would stay gathered for the whole
    step and after every no-grad forward; in their own units each is gathered only while it
    computes (and again for its backward). Tied embeddings are one parameter, which must stay in
    one unit: they stay in the root, gathered as before."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    embeddings, head = base.get_input_embeddings(), base.get_output_embeddings()
    if head is not None and any(p is q for p in head.parameters() for q in embeddings.parameters()):
        return []
    return [m for m in (embeddings, head) if m is not None]


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder block's activations in the backward instead of keeping them
    (Hugging Face's per-block checkpointing, non-reentrant, so LoRA and FSDP2 work with it)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


@torch.no_grad()
def packing_supported(model: nn.Module, device: torch.device) -> bool:
    """Whether `model` reads position_ids that restart at 0 as separate sequences (block-diagonal
    attention, see `miles.trainer.batching`): two sequences packed into one row must give the
    logits each gives alone. Models whose masks ignore position_ids attend across the boundary
    and differ by a large fraction of the logits' scale. A collective forward under FSDP2."""
    lengths = (4, 3)
    ids = torch.arange(sum(lengths), device=device).unsqueeze(0) % model.config.vocab_size
    positions = torch.cat([torch.arange(n, device=device) for n in lengths]).unsqueeze(0)
    packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0]
    alone = torch.cat([model(input_ids=part, use_cache=False).logits[0]
                       for part in ids.split(lengths, dim=1)])
    return _same_logits(model, packed, alone)


def _same_logits(model: nn.Module, got: torch.Tensor, expected: torch.Tensor) -> bool:
    """A probe's verdict: `got` within 2% of `expected`'s scale (a layout the model misreads
    differs by a large fraction of it). Reshards the FSDP2 root, which a forward leaves
    gathered."""
    if isinstance(model, FSDPModule):
        model.reshard()
    scale = float(expected.abs().max())
    return float((got - expected).abs().max()) <= 0.02 * max(scale, 1e-6)


@torch.no_grad()
def shared_prompts_supported(model: nn.Module, device: torch.device) -> bool:
    """Whether `model` honours a custom [R, 1, T, T] boolean attention mask, so samples can share
    one copy of their prompt in a line (`miles.trainer.batching`, `pack_rows`): a prompt of 3
    tokens shared by responses of 2 and 3 tokens must give the logits each sample gives alone.
    A collective forward under FSDP2."""
    vocab = model.config.vocab_size
    prompt, responses = [1, 2, 3], [[4, 5], [6, 7, 8]]
    ids = torch.tensor([prompt + responses[0] + responses[1]], device=device) % vocab
    positions = torch.tensor([[0, 1, 2, 3, 4, 3, 4, 5]], device=device)
    seq = np.array([[0, 0, 0, 1, 1, 2, 2, 2]])
    sees = np.array([[-1, -1, -1, 0, 0, 0, 0, 0]])
    mask = visibility(seq, sees).to(device)
    try:  # an attention kernel without custom masks (FlashAttention-2) may refuse it outright
        shared = model(input_ids=ids, position_ids=positions, attention_mask=mask,
                       use_cache=False).logits[0]
    except (RuntimeError, ValueError, TypeError) as err:
        log.info("no shared prompts: the model refuses a 4D attention mask (%s)", err)
        return False
    alone = [model(input_ids=torch.tensor([prompt + r], device=device) % vocab,
                   use_cache=False).logits[0] for r in responses]
    expected = torch.cat([alone[0], alone[1][3:]])  # the prompt's logits, then each response's
    return _same_logits(model, shared, expected)


def is_lora_b(name: str) -> bool:
    """Whether the parameter called `name` is a LoRA adapter's B (up-projection) matrix."""
    return "lora_B" in name.split(".")


def trainable_names(model: nn.Module) -> set[str]:
    """Fully qualified names of the parameters the optimizer updates."""
    return {name for name, param in model.named_parameters() if param.requires_grad}


def export_full(model: nn.Module, out_dir: str | Path) -> Path | None:
    """Write the whole (fully fine-tuned) model as a Hugging Face folder with one
    `model.safetensors` (tied weights once). A collective like `export_adapter`; rank 0 writes."""
    if hasattr(model, "peft_config"):
        raise MilesError("export_full is for fully trained models; this one has a LoRA adapter")
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(model, options=options)  # collective: all-gathers the shards
    if not distributed.is_main():
        return None
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, state_dict=full, max_shard_size="10000GB")
    return out_dir


def export_adapter(model: nn.Module, out_dir: str | Path) -> Path | None:
    """Write the LoRA adapter as peft does (`adapter_model.safetensors`, `adapter_config.json`;
    peft's model card is left out).

    A collective: every rank must call it; the full (unsharded) adapter is gathered to CPU and
    rank 0 writes it. Returns `out_dir` on rank 0, None elsewhere.
    """
    from safetensors.torch import save_file

    if not hasattr(model, "peft_config"):
        raise MilesError("export_adapter needs a LoRA (peft) model; this one is fully trained")
    trained = gathered_trainable(model)
    if not distributed.is_main():
        return None
    adapter = {key: trained[name] for name, key in adapter_keys(model, trained).items()}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({name: tensor.contiguous() for name, tensor in adapter.items()},
              str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    replace(model.peft_config[ADAPTER_NAME], inference_mode=True).save_pretrained(str(out_dir))
    return out_dir


def adapter_keys(model: nn.Module, trained: dict[str, torch.Tensor]) -> dict[str, str]:
    """The key in peft's adapter file of each of `trained`'s parameters that go in it: peft's
    own mapping (`get_peft_model_state_dict`), worked out once per model (it took 4 ms, 40% of
    the demo's export, on every version)."""
    from peft import get_peft_model_state_dict

    keys = _ADAPTER_KEYS.get(model)
    if keys is None:
        adapter = get_peft_model_state_dict(model, state_dict=trained, adapter_name=ADAPTER_NAME,
                                            save_embedding_layers=False)
        names = {id(tensor): name for name, tensor in trained.items()}
        keys = _ADAPTER_KEYS[model] = {names[id(tensor)]: key for key, tensor in adapter.items()}
    return keys


_ADAPTER_KEYS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def gathered_trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trained parameters, whole, on the CPU. A collective: each sharded parameter is
    all-gathered, in the same order on every rank."""
    return {name: _whole(param).detach().to("cpu", copy=True)
            for name, param in model.named_parameters() if param.requires_grad}


def _whole(param: torch.Tensor) -> torch.Tensor:
    """`param` unsharded: a DTensor's local tensor when its mesh is one rank (the whole tensor;
    the demo's 56 LoRA tensors are copied out in 1.0 ms this way, 3.5 ms through `full_tensor`'s
    redistribution), else the all-gathered `full_tensor()`."""
    if not isinstance(param, DTensor):
        return param
    return param.to_local() if param.device_mesh.size() == 1 else param.full_tensor()
