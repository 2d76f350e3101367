"""GPU verification: the trainer's learner with FSDP2 over NCCL, bf16 and torch.compile on a ~1B
model.

Run by hand on a machine with CUDA (not a test; finishes in a few minutes), from the repository
root:

    python benchmarks/gpu_check.py                      # one GPU, world size 1
    torchrun --nproc_per_node 8 benchmarks/gpu_check.py # all GPUs of a node

Without CUDA it exits at once with code 2 and says why (`--cpu` runs the same code on the CPU
with gloo and fp32, a smoke test of this script whose numbers mean nothing).

What it does, with the trainer's own parts:
- rank 0 writes a Llama-style model built from a config (default: TinyLlama-1.1B's shape,
  hidden 2048, 22 layers, MLP 5632, 32 heads, 4 KV heads, vocab 32,000, untied: 1.10B
  parameters) and a tokenizer to a folder, as `save_pretrained` does for any checkpoint;
- every rank builds `miles.trainer.learner.Learner` from it: `learner.sharded_load` (meta
  device, each rank reads its slices), `learner.precision=bf16` (FSDP2 MixedPrecisionPolicy,
  fp32 reduce and master weights), `learner.compile` (each decoder block), sequence packing,
  full fine-tuning by default (`--lora` for LoRA r=16), GRPO;
- `train_step` on synthetic trajectory groups (`--groups` x `--samples` samples of `--prompt`
  + `--response` random tokens, rewards alternating 0/1), the same groups on every rank as the
  trainer daemon ships them: `--warmup` untimed steps (compilation happens there), then
  `--steps` timed ones;
- reports tokens/s (the global batch over the step time), model FLOPs utilisation against the
  GPU's dense bf16 peak (`PEAK_BF16_FLOPS`; unknown GPUs report achieved TFLOPS only), peak
  memory (`torch.cuda.max_memory_allocated` over the timed steps, rank 0) next to
  `miles.trainer.memory`'s estimate for the same setup, and the save and load time of the
  trainer's checkpoint (`miles.trainer.checkpoint`, `torch.distributed.checkpoint` of weights
  and optimizer state; checked by restoring a trainable parameter that was zeroed after the
  save).
The last line of output is one JSON object with every number.

Model FLOPs per token: 6 x (parameters in matmuls: all but the input embedding) plus the
attention's 12 x layers x hidden x sequence length (PaLM, Chowdhery et al. 2022, appendix B; no
causal halving), so MFU is comparable with other reports. With LoRA the frozen weights still
cost their forward and input-gradient FLOPs, so 6N stays a fair model-FLOPs count.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # miles and tests.factories, when run as a script from a checkout
NO_CUDA_EXIT = 2
PEAK_BF16_FLOPS = (  # dense bf16 tensor-core peaks (vendor datasheets); first match wins
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM
    ("H200", 989e12),  # also GH200
    ("H800", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("A10G", 70e12),
    ("L4", 121e12),
)


def peak_flops(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s of a GPU from its `torch.cuda.get_device_name`, None if unknown."""
    for key, flops in PEAK_BF16_FLOPS:
        if key.lower() in device_name.lower():
            return flops
    return None


def flops_per_token(*, matmul_params: int, layers: int, hidden: int, seq: int) -> float:
    """Training FLOPs per token (forward + backward): 6N plus causal attention's 12 L H T."""
    return 6.0 * matmul_params + 12.0 * layers * hidden * seq


def mfu(tokens_per_s_per_gpu: float, flops_token: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak (None without a peak)."""
    return None if not peak else tokens_per_s_per_gpu * flops_token / peak


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--groups", type=int, default=8, help="trajectory groups per step (global)")
    p.add_argument("--samples", type=int, default=8, help="samples per group")
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens per group")
    p.add_argument("--response", type=int, default=768, help="response tokens per sample")
    p.add_argument("--micro-tokens", type=int, default=8192,
                   help="learner.max_tokens_per_micro_batch")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps (compilation)")
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--lora", action="store_true", help="LoRA r=16 instead of full fine-tuning")
    p.add_argument("--checkpointing", action="store_true",
                   help="learner.activation_checkpointing")
    p.add_argument("--no-compile", action="store_true", help="eager blocks")
    p.add_argument("--cpu", action="store_true",
                   help="run on the CPU (gloo, fp32): a smoke test of this script")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="where the model and the checkpoint go (default: a temporary folder, "
                        "removed; on several nodes pass a shared folder)")
    return p.parse_args(argv)


def shared_folder(given: Path | None) -> Path:
    """`given`, or a temporary folder made by rank 0 whose path every rank receives."""
    from miles.trainer import distributed

    if given is not None:
        return given
    path = tempfile.mkdtemp(prefix="miles-gpu-check-") if distributed.is_main() else None
    return Path(distributed.broadcast_bytes(path.encode() if path else None).decode())


def write_model(args, out: Path):
    """Rank 0 writes the model of the arguments (fp32 safetensors) and a tokenizer to `out`;
    returns its config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from miles.tasks.tiny_model import build_char_tokenizer
    from miles.trainer import distributed

    tokenizer = build_char_tokenizer()  # ids < 78: the model's vocabulary is padded beyond
    config = AutoConfig.for_model(
        "llama", vocab_size=args.vocab, hidden_size=args.hidden,
        intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(args.prompt + args.response, 2048),
        tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    if distributed.is_main():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
        tokenizer.save_pretrained(out)
    distributed.barrier()
    return config


def make_groups(args) -> list:
    """The synthetic trajectory groups of one step (see the module docstring)."""
    import numpy as np

    from tests.factories import make_group, make_sample

    return [make_group(prompt_tokens=args.prompt, vocab_size=args.vocab, seed=g,
                       samples=[make_sample(args.response, vocab_size=args.vocab, seed=g * 1000 + i,
                                            reward=float(i % 2),
                                            logprobs=np.full(args.response, -2.0, np.float32))
                                for i in range(args.samples)])
            for g in range(args.groups)]


def learner_config(args):
    from miles.trainer.learner import LearnerConfig

    return LearnerConfig(lr=1e-5, precision="fp32" if args.cpu else "bf16",
                         compile=not args.no_compile, sharded_load=True,
                         activation_checkpointing=args.checkpointing,
                         max_tokens_per_micro_batch=args.micro_tokens)


def timed_steps(learner, groups, steps: int, sync) -> tuple[float, dict]:
    """Seconds per `train_step` over `steps` steps, and the last step's metrics."""
    metrics: dict = {}
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        metrics = learner.train_step(groups)
    sync()
    return (time.perf_counter() - start) / max(steps, 1), metrics


def checkpoint_round_trip(learner, folder: Path) -> dict:
    """Save the learner's state with the trainer's checkpoint code, zero one trainable
    parameter, load, check it came back."""
    import torch
    from torch.distributed.tensor import DTensor

    from miles.trainer import distributed
    from miles.trainer.checkpoint import load_checkpoint, save_checkpoint

    distributed.barrier()
    start = time.perf_counter()
    path = save_checkpoint(folder, learner.steps, learner.state_dict(), {"offsets": {}})
    distributed.barrier()
    save_s = time.perf_counter() - start
    probe = learner.params[0]
    local = probe.to_local() if isinstance(probe, DTensor) else probe
    expected = local.detach().clone()
    with torch.no_grad():
        local.zero_()
    start = time.perf_counter()
    state = learner.state_dict()
    load_checkpoint(path, state)
    learner.load_state_dict(state)
    distributed.barrier()
    load_s = time.perf_counter() - start
    ok = torch.equal(local.detach(), expected)
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return {"save_s": round(save_s, 2), "load_s": round(load_s, 2), "restored": ok,
            "checkpoint_gib": round(size / 2**30, 2)}


def memory_estimate(config, args, world: int) -> float:
    """`miles.trainer.memory`'s per-rank step estimate (GiB) for this setup."""
    from miles.trainer.memory import GIB, ModelShape, estimate_memory, trainer_plan
    from miles.trainer.model import LoraSettings

    plan = replace(trainer_plan(lora=LoraSettings() if args.lora else None,
                                learner=learner_config(args)), ranks=world)
    return estimate_memory(ModelShape.from_hf_config(config.to_dict()), plan).step / GIB


def run(args) -> dict:
    import torch

    from miles.trainer import distributed
    from miles.trainer.learner import Learner
    from miles.trainer.model import LoraSettings

    device = distributed.init_distributed()  # NCCL on CUDA (torchrun's env or a world of one)
    world = distributed.world_size()
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    work = shared_folder(args.work_dir)
    try:
        start = time.perf_counter()
        config = write_model(args, work / "model")
        write_s = time.perf_counter() - start
        start = time.perf_counter()
        learner = Learner(work / "model", learner_config(args),
                          lora=LoraSettings() if args.lora else None)
        build_s = time.perf_counter() - start
        params = sum(p.numel() for p in learner.model.parameters())
        groups = make_groups(args)
        warmup_s, first = timed_steps(learner, groups, args.warmup, sync)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        step_s, last = timed_steps(learner, groups, args.steps, sync)
        peak_bytes = torch.cuda.max_memory_allocated(device) if cuda else 0
        checkpoint = checkpoint_round_trip(learner, work / "checkpoints")
    finally:
        distributed.barrier()
        if args.work_dir is None and distributed.is_main():
            shutil.rmtree(work, ignore_errors=True)
    sequence = args.prompt + args.response
    tokens_per_step = args.groups * args.samples * sequence
    tokens_per_s = tokens_per_step / step_s
    per_token = flops_per_token(matmul_params=params - args.vocab * args.hidden,
                                layers=args.layers, hidden=args.hidden, seq=sequence)
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    peak = peak_flops(name) if cuda else None
    fraction = mfu(tokens_per_s / world, per_token, peak)
    return {
        "device": name, "world_size": world, "torch": torch.__version__,
        "parameters": params, "lora": args.lora, "compile": not args.no_compile,
        "precision": str(learner.dtype).removeprefix("torch."), "packing": learner.packing,
        "tokens_per_step": tokens_per_step, "write_model_s": round(write_s, 1),
        "build_s": round(build_s, 1), "warmup_s": round(warmup_s * args.warmup, 1),
        "step_s": round(step_s, 4), "tokens_per_s": round(tokens_per_s),
        "tflops_per_gpu": round(tokens_per_s / world * per_token / 1e12, 1),
        "peak_tflops": peak / 1e12 if peak else None,
        "mfu": round(fraction, 3) if fraction is not None else None,
        "peak_memory_gib": round(peak_bytes / 2**30, 2),
        "estimated_memory_gib": round(memory_estimate(config, args, world), 2),
        "loss_first": round(first.get("trainer/loss", float("nan")), 4),
        "loss_last": round(last.get("trainer/loss", float("nan")), 4),
        "grad_norm_last": round(last.get("trainer/grad_norm", float("nan")), 4),
        **checkpoint,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch sees a GPU: gloo and the CPU
    import torch

    if not torch.cuda.is_available() and not args.cpu:
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False, torch "
              f"{torch.__version__}); this check needs an NVIDIA GPU and runs nothing "
              "without one (--cpu runs it on the CPU as a smoke test).", file=sys.stderr)
        return NO_CUDA_EXIT
    from miles.trainer import distributed

    try:
        result = run(args)
        if distributed.is_main():
            for key, value in result.items():
                print(f"{key:>22}: {value}")
            print(json.dumps(result))
    finally:
        distributed.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
