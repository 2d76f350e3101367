"""How much memory one trainer rank needs: a planning estimate, not a promise.

`estimate_memory(shape, plan)` adds up, per rank, what the learner keeps and what one training
step allocates on top, from a model's shape (`ModelShape`, e.g. read from a Hugging Face
`config.json`) and how it is trained (`Plan`: LoRA or full fine-tuning, critic, reference,
dtype, FSDP2 ranks, micro-batch tokens). `check_fits` turns an estimate and a device's memory
into a warning. The trainer calls `check_trainer_memory` before it loads anything, so a run that
cannot fit says so at once instead of failing minutes later; it never refuses to start.
`python -m miles.trainer.memory` prints the tables of `docs/scaling.md`.

Assumptions (each a named constant or a line below):
- Llama-style decoder blocks (q/k/v/o projections, gated MLP gate/up/down, two RMSNorms);
  Qwen2 and Mistral have the same shape. Other blocks are estimated as if they had it.
- Copies: under LoRA one frozen base serves actor, critic (a second adapter + a value head) and
  reference (adapters disabled); under full fine-tuning the critic is a second full model plus
  a value head (all of it counted trainable) and the reference a frozen copy. The old (proximal)
  policy is never a copy: its logprobs are scored before the update.
- Bytes per parameter: "fp32" keeps everything in fp32 (4 B weight, 4 B gradient); "bf16" keeps
  weights and gradients in bf16 plus an fp32 master copy of the trainable ones (2 + 2 + 4 B).
  AdamW adds two fp32 moments (8 B) per trainable parameter, so a trainable parameter costs
  16 B either way; FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) with fp32
  sharded parameters also comes to 4 + 4 + 8 B. Frozen weights cost 4 or 2 B.
- FSDP2 shards weights, gradients and optimizer state evenly over the ranks (padding ignored).
  During a step the vocabulary matrices count as gathered (tied: they stay in the root unit,
  gathered through forward and backward; untied: embeddings and head are units of their own,
  and at the peak one of them is gathered next to its all-gather buffer: the same bytes), and
  `GATHERED_BLOCKS` decoder blocks are unsharded at once (the one computing and the one being
  prefetched); unsharded gradients of the root and of one block wait for their reduce-scatter.
- Activations: SDPA/flash attention (no [T, T] scores); per token and block autograd keeps
  `a * hidden + 2 * kv_dim + 4 * intermediate` values in the compute dtype (norm inputs and
  outputs, q, attention output, k, v, gate, up, SiLU(gate), their product), a =
  `ACTIVATION_HIDDEN_VALUES` (bf16 counts the RMSNorms' fp32 upcasts), as measured with saved-
  tensor hooks on transformers' Llama (tests/unit/test_memory.py checks it). peft computes LoRA
  in fp32 over a bf16 base it did not cast (its default), which keeps about 10 more. With
  activation checkpointing per block: the block inputs plus one block's worth.
  The actor's and the critic's graphs are never alive together (the learner backpropagates
  one before building the other), so a critic adds no activations.
- Logits: `LOGITS_FP32_COPIES` fp32 [tokens, vocab] tensors at the peak (upcast, processed,
  log-softmax, the entropy's softmax...).
- Load: by default the learner materialises each copy in full on every rank and then shards it
  (`miles.trainer.model`), so loading peaks at the largest copy unsharded next to the shards
  already made; with meta-device loading (`Plan.meta_init`, `learner.sharded_load`) that
  transient is gone. On
  CPU, copies loaded from the same safetensors file share page cache: an upper bound there.
- `RUNTIME_BYTES` for everything else (CUDA/NCCL or gloo buffers, allocator slack); the
  warning fires at `FIT_FRACTION` of the device's memory, which leaves room for fragmentation.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from miles.engines.base import LoraSettings
from miles.errors import ConfigError

log = logging.getLogger(__name__)

GIB = 2**30
DTYPE_BYTES = {"fp32": 4, "bf16": 2}
FP32 = 4  # master weights, AdamW moments, reduce-scatter buffers, logits
ADAM_STATES = 2  # exp_avg and exp_avg_sq, fp32
GATHERED_BLOCKS = 2  # decoder blocks unsharded at once: the current one and the prefetched one
ACTIVATION_HIDDEN_VALUES = {"fp32": 8, "bf16": 10}  # hidden-sized values kept per token and block
LOGITS_FP32_COPIES = 5  # fp32 [tokens, vocab] tensors alive at the loss's peak
RUNTIME_BYTES = 1 * GIB  # CUDA/NCCL (or gloo) buffers, allocator slack
FIT_FRACTION = 0.9  # warn when the estimate exceeds this share of the device's memory

BLOCK_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QKV_BIAS_MODELS = ("qwen2",)  # model types whose q/k/v projections always have a bias


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The sizes of a Llama-style causal LM that memory depends on."""

    hidden: int  # hidden_size
    layers: int  # num_hidden_layers
    intermediate: int  # intermediate_size (gated MLP)
    vocab: int  # vocab_size
    heads: int  # num_attention_heads
    kv_heads: int  # num_key_value_heads (GQA); = heads without GQA
    head_dim: int = 0  # 0: hidden // heads
    tied_embeddings: bool = False  # tie_word_embeddings: the LM head reuses the embeddings
    biased: tuple[str, ...] = ()  # block linears with a bias (Qwen2: q/k/v)

    @classmethod
    def from_hf_config(cls, config: Mapping) -> ModelShape:
        """The shape of a Hugging Face `config.json` (as a dict)."""
        try:
            heads = int(config["num_attention_heads"])
            hidden = int(config["hidden_size"])
            biased = (BLOCK_LINEARS[:4] if config.get("attention_bias") else
                      BLOCK_LINEARS[:3] if config.get("model_type") in QKV_BIAS_MODELS else ())
            if config.get("mlp_bias"):
                biased += BLOCK_LINEARS[4:]
            return cls(hidden=hidden, layers=int(config["num_hidden_layers"]),
                       intermediate=int(config["intermediate_size"]),
                       vocab=int(config["vocab_size"]), heads=heads,
                       kv_heads=int(config.get("num_key_value_heads") or heads),
                       head_dim=int(config.get("head_dim") or hidden // heads),
                       tied_embeddings=bool(config.get("tie_word_embeddings", False)),
                       biased=biased)
        except KeyError as exc:
            raise ConfigError(f"config.json has no {exc.args[0]!r}: not a Llama-style model "
                              "the memory estimate knows") from exc

    @property
    def q_dim(self) -> int:
        return self.heads * (self.head_dim or self.hidden // self.heads)

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * (self.head_dim or self.hidden // self.heads)

    def linears(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each linear of one decoder block, and the LM head."""
        h, i = self.hidden, self.intermediate
        return {"q_proj": (h, self.q_dim), "k_proj": (h, self.kv_dim),
                "v_proj": (h, self.kv_dim), "o_proj": (self.q_dim, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
                "lm_head": (h, self.vocab)}

    def block_parameters(self) -> int:
        """Parameters of one decoder block: its linears, their biases, two RMSNorm weights."""
        shapes = self.linears()
        return sum(a * b + (b if name in self.biased else 0)
                   for name, (a, b) in shapes.items() if name in BLOCK_LINEARS) + 2 * self.hidden

    def root_parameters(self) -> int:
        """Parameters outside the blocks: embeddings, final norm, and an untied LM head."""
        embeddings = self.vocab * self.hidden
        return embeddings * (1 if self.tied_embeddings else 2) + self.hidden

    def parameters(self) -> int:
        return self.layers * self.block_parameters() + self.root_parameters()

    def lora_parameters(self, lora: LoraSettings) -> tuple[int, int]:
        """Parameters of one LoRA adapter, (per decoder block, on the LM head): r * (in + out)
        per targeted linear (peft's A and B); the adapter has `layers * block + head`."""
        shapes = self.linears()
        unknown = [name for name in lora.target_modules if name not in shapes]
        if unknown:
            raise ConfigError(f"lora.target_modules {unknown} are unknown to the memory "
                              f"estimate (it knows {sorted(shapes)})")
        per_block = sum(lora.r * sum(shapes[name]) for name in lora.target_modules
                        if name in BLOCK_LINEARS)
        head = lora.r * sum(shapes["lm_head"]) if "lm_head" in lora.target_modules else 0
        return per_block, head


@dataclass(frozen=True, kw_only=True)
class Plan:
    """How the model is trained: what `estimate_memory` needs besides the shape."""

    lora: LoraSettings | None = field(default_factory=LoraSettings)  # None: full fine-tuning
    critic: bool = False  # PPO's value model (estimator "gae")
    reference: bool = False  # a reference policy (KL term, loss.kl_coef > 0)
    dtype: str = "fp32"  # compute dtype: "fp32" or "bf16" (with fp32 master weights)
    ranks: int = 1  # FSDP2 ranks sharing the state
    tokens: int = 8192  # tokens per micro-batch (learner.max_tokens_per_micro_batch)
    activation_checkpointing: bool = False  # per decoder block (learner.activation_checkpointing)
    meta_init: bool = False  # False: each copy is materialised on every rank, then sharded
    cpu_offload: bool = False  # sharded weights, gradients and optimizer state in host memory

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(f"dtype must be one of {list(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.ranks < 1 or self.tokens < 1:
            raise ConfigError(f"ranks and tokens must be >= 1, got {self.ranks}, {self.tokens}")


@dataclass(frozen=True)
class Estimate:
    """Bytes per rank. `components` add up to the step's peak on the device; `load` is the peak
    while the learner loads (before any optimizer state exists)."""

    components: dict[str, int]  # weights, gradients, optimizer, gathered, activations, ...
    load: int  # load-time peak on the device
    host: int = 0  # bytes moved to host memory by CPU offload
    parameters: int = 0  # parameters of one copy of the model
    trainable: int = 0  # trainable parameters over all copies

    @property
    def step(self) -> int:
        return sum(self.components.values())

    @property
    def total(self) -> int:
        """The peak: the larger of the step's and the load's."""
        return max(self.step, self.load)

    def describe(self) -> str:
        parts = ", ".join(f"{name} {gib(value)}" for name, value in self.components.items())
        return f"{gib(self.total)} GiB ({parts}; load {gib(self.load)})"


def gib(value: int) -> str:
    return f"{value / GIB:.1f}"


def estimate_memory(shape: ModelShape, plan: Plan) -> Estimate:
    """Per-rank bytes of training `shape` as `plan` says (see the module docstring)."""
    weight_bytes = DTYPE_BYTES[plan.dtype]
    master = FP32 if plan.dtype != "fp32" else 0
    params = shape.parameters()
    head = shape.hidden + 1  # the value head Linear(hidden, 1)
    if plan.lora is not None:
        block_adapter, head_adapter = shape.lora_parameters(plan.lora)
        copies = 2 if plan.critic else 1  # actor adapter, and the critic's
        block_extra = copies * block_adapter  # adapters of one block, gathered with it
        root_trainable = copies * head_adapter
        trainable = shape.layers * block_extra + root_trainable + (head if plan.critic else 0)
        frozen = params
        block_trainable = block_extra
    else:
        trainable = params + (params + head if plan.critic else 0)
        frozen = params if plan.reference else 0
        block_extra = 0
        root_trainable, block_trainable = shape.root_parameters(), shape.block_parameters()
    n = plan.ranks
    states = {"weights": (trainable + frozen) * weight_bytes // n,
              "gradients": trainable * weight_bytes // n,
              "optimizer": trainable * (ADAM_STATES * FP32 + master) // n}
    host = sum(states.values()) if plan.cpu_offload else 0
    components = {name: 0 if plan.cpu_offload else value for name, value in states.items()}
    gathered = ((shape.root_parameters() + GATHERED_BLOCKS * (shape.block_parameters()
                                                              + block_extra)) * weight_bytes
                + (root_trainable + block_trainable) * FP32)
    components.update(gathered=gathered,
                      activations=activation_bytes(shape, plan.tokens, plan.dtype,
                                                   plan.activation_checkpointing),
                      logits=plan.tokens * shape.vocab * FP32 * LOGITS_FP32_COPIES,
                      runtime=RUNTIME_BYTES)
    materialised = 0 if plan.meta_init else params * weight_bytes * (n - 1) // n
    load = components["weights"] + materialised + RUNTIME_BYTES
    return Estimate(components, load, host=host, parameters=params, trainable=trainable)


def activation_bytes(shape: ModelShape, tokens: int, dtype: str, checkpointing: bool) -> int:
    """Bytes autograd keeps for the backward of one micro-batch of `tokens` tokens."""
    per_block = (ACTIVATION_HIDDEN_VALUES[dtype] * shape.hidden + 2 * shape.kv_dim
                 + 4 * shape.intermediate)  # values per token
    if checkpointing:  # block inputs, plus one block recomputed during its backward
        return tokens * (shape.layers * shape.hidden + per_block) * DTYPE_BYTES[dtype]
    return tokens * shape.layers * per_block * DTYPE_BYTES[dtype]


def max_tokens(shape: ModelShape, plan: Plan, device_bytes: int, *,
               fraction: float = FIT_FRACTION, limit: int = 2**20) -> int:
    """The largest micro-batch (tokens, up to `limit`) whose estimate fits `fraction` of
    `device_bytes`; 0 when even one token does not (or loading alone does not fit)."""
    def fits(tokens: int) -> bool:
        est = estimate_memory(shape, replace(plan, tokens=tokens))
        return est.total <= fraction * device_bytes

    low, high = 0, limit
    while low < high:  # the estimate grows with tokens: bisect for the last that fits
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


HINTS = {
    "weights": "shard over more ranks, train LoRA, or offload to CPU",
    "gradients": "shard over more ranks, train LoRA, or offload to CPU",
    "optimizer": "shard over more ranks, train LoRA, or offload to CPU",
    "gathered": "use a model with smaller blocks or vocabulary",
    "activations": "lower learner.max_tokens_per_micro_batch (or checkpoint activations)",
    "logits": "lower learner.max_tokens_per_micro_batch",
    "runtime": "free the device of other processes",
}


def check_fits(estimate: Estimate, device_bytes: int, *, where: str = "the device",
               fraction: float = FIT_FRACTION) -> str | None:
    """A warning when `estimate` exceeds `fraction` of `device_bytes`, else None."""
    if estimate.total <= fraction * device_bytes:
        return None
    phase = "loading" if estimate.load > estimate.step else "a training step"
    largest = max(estimate.components, key=estimate.components.get)
    return (f"estimated peak memory {gib(estimate.total)} GiB per rank (during {phase}) exceeds "
            f"{fraction:.0%} of the {gib(device_bytes)} GiB of {where}: expect an out-of-memory "
            f"error. Estimate: {estimate.describe()}. Largest part: {largest}; "
            f"{HINTS[largest]}. A planning estimate (docs/scaling.md), not a measurement.")


def device_memory() -> tuple[int, str]:
    """(bytes, description) of the memory one rank of this host may use: free CUDA memory of
    this rank's GPU, or on CPU the host's RAM divided by the local ranks."""
    import torch

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        free, _total = torch.cuda.mem_get_info(local_rank)
        return free, f"free memory on cuda:{local_rank}"
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            total = int(line.split()[1]) * 1024
            return total // local_ranks, f"host RAM / {local_ranks} local rank(s)"
    raise OSError("/proc/meminfo has no MemTotal")


def trainer_plan(*, lora: LoraSettings | None, learner) -> Plan:
    """The `Plan` of a learner (`LearnerConfig`) over torchrun's WORLD_SIZE ranks."""
    import torch

    from miles.trainer.precision import compute_dtype

    algorithm = learner.algorithm
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bf16 = compute_dtype(learner.precision, device) == torch.bfloat16
    return Plan(lora=lora, critic=algorithm.uses_critic, reference=algorithm.uses_reference,
                dtype="bf16" if bf16 else "fp32", ranks=int(os.environ.get("WORLD_SIZE", "1")),
                tokens=learner.max_tokens_per_micro_batch,
                activation_checkpointing=learner.activation_checkpointing,
                meta_init=learner.sharded_load, cpu_offload=learner.cpu_offload)


def check_trainer_memory(model_dir: str | Path, *, lora: LoraSettings | None,
                         learner) -> str | None:
    """Estimate the trainer's peak from `model_dir/config.json` and warn (the returned string)
    if it will not fit this rank's device. Logs the estimate; an estimate that cannot be made
    is logged and returns None (the learner's own loading reports a bad model directory)."""
    try:
        estimate = estimate_memory(load_shape(str(model_dir)),
                                   trainer_plan(lora=lora, learner=learner))
        available, where = device_memory()
    except (OSError, ValueError, ConfigError) as exc:
        log.info("no memory estimate: %s", exc)
        return None
    log.info("memory estimate per rank: %s; %s: %s GiB", estimate.describe(), where,
             gib(available))
    return check_fits(estimate, available, where=where)


# -- the tables of docs/scaling.md ---------------------------------------------------------------

MODELS = {  # Llama-2 configs (Touvron et al. 2023; the config.json files of meta-llama/Llama-2-*)
    "llama2-7b": ModelShape(hidden=4096, layers=32, intermediate=11008, vocab=32000, heads=32,
                            kv_heads=32),
    "llama2-70b": ModelShape(hidden=8192, layers=80, intermediate=28672, vocab=32000, heads=64,
                             kv_heads=8),
}
SETUPS = {  # name: (LoRA, critic, reference)
    "LoRA GRPO": (True, False, False),
    "LoRA PPO + KL": (True, True, True),
    "full GRPO": (False, False, False),
    "full GRPO + KL": (False, False, True),
    "full PPO + KL": (False, True, True),
}
SETTINGS = {  # name: Plan fields
    "fp32": dict(dtype="fp32"),  # learner.precision=fp32 (the default on CPU), plain loading
    "fp32-checkpointing": dict(dtype="fp32", activation_checkpointing=True),
    "recommended": dict(dtype="bf16", activation_checkpointing=True, meta_init=True),
    "offload": dict(dtype="bf16", activation_checkpointing=True, meta_init=True,
                    cpu_offload=True),
}
COLUMNS = ("weights", "gradients", "optimizer", "gathered", "activations", "logits")


def memory_table(shape: ModelShape, *, settings: str, ranks: list[int], tokens: int,
                 device_gib: float, lora: LoraSettings = LoraSettings()) -> str:
    """A markdown table of `estimate_memory` for every setup of `SETUPS` on `ranks` ranks."""
    offload = SETTINGS[settings].get("cpu_offload", False)
    header = ["setup", "ranks", "trainable", *COLUMNS, "step", "load",
              *(["host / node"] if offload else []), f"fits {device_gib:g} GiB", "max tokens"]
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    for name, (use_lora, critic, reference) in SETUPS.items():
        for n in ranks:
            plan = Plan(lora=lora if use_lora else None, critic=critic, reference=reference,
                        ranks=n, tokens=tokens, **SETTINGS[settings])
            e = estimate_memory(shape, plan)
            fits = check_fits(e, int(device_gib * GIB)) is None
            most = max_tokens(shape, plan, int(device_gib * GIB))
            host = [gib(e.host * min(n, 8))] if offload else []  # 8 ranks per node
            row = [name, str(n), f"{e.trainable / 1e9:.2f}B",
                   *(gib(e.components[c]) for c in COLUMNS), gib(e.step), gib(e.load), *host,
                   "yes" if fits else "no", f"{most:,}" if most else "-"]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def load_shape(name: str) -> ModelShape:
    """A shape of `MODELS`, or of a model directory / config.json."""
    if name in MODELS:
        return MODELS[name]
    path = Path(name)
    path = path / "config.json" if path.is_dir() else path
    return ModelShape.from_hf_config(json.loads(path.read_text()))


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m miles.trainer.memory",
                                     description="Per-rank memory tables (GiB = 2**30 bytes).")
    parser.add_argument("models", nargs="*", default=list(MODELS),
                        help=f"{', '.join(MODELS)}, or a model directory / config.json")
    parser.add_argument("--settings", choices=list(SETTINGS), default="recommended")
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per micro-batch")
    parser.add_argument("--device-gib", type=float, default=79.2,
                        help="device memory; an 80 GB H100 reports 79.2 GiB")
    parser.add_argument("--lora-r", type=int, default=16)
    args = parser.parse_args(argv)
    for model in args.models:
        shape = load_shape(model)
        print(f"{model}: {shape.parameters() / 1e9:.2f}B parameters, settings "
              f"{args.settings} {SETTINGS[args.settings]}, {args.tokens} tokens per "
              "micro-batch\n")
        print(memory_table(shape, settings=args.settings, ranks=args.ranks, tokens=args.tokens,
                           device_gib=args.device_gib, lora=LoraSettings(r=args.lora_r)))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
