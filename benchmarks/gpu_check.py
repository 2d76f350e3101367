"""GPU verification: FSDP2 over NCCL, bf16 mixed precision and torch.compile on a ~1B model.

Run by hand on a machine with CUDA (not a test; finishes in a few minutes), from the repository
root:

    python benchmarks/gpu_check.py                      # one GPU, world size 1
    torchrun --nproc_per_node 8 benchmarks/gpu_check.py # all GPUs of a node

Without CUDA it exits at once with code 2 and says why.

What it does, in the trainer's recipe (`miles.trainer.model.apply_fsdp`: each decoder block
compiled with `Module.compile()`, then one `fully_shard` unit per block, then the root):
- builds a Llama-style model from a config on the GPU (default: TinyLlama-1.1B's shape, hidden
  2048, 22 layers, MLP 5632, 32 heads, 4 KV heads, vocab 32,000, untied: 1.10B parameters),
  fp32 master weights;
- FSDP2 over NCCL with `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`;
- AdamW, a plain next-token loss on random tokens (`--batch` x `--seq` per rank per step):
  `--warmup` untimed steps (compilation happens there), then `--steps` timed ones;
- reports tokens/s (all ranks), model FLOPs utilisation against the GPU's dense bf16 peak
  (`PEAK_BF16_FLOPS`; unknown GPUs report achieved TFLOPS only), peak memory
  (`torch.cuda.max_memory_allocated` over the timed steps, rank 0) next to
  `miles.trainer.memory`'s estimate for the same setup (which assumes Miles's RL loss, a few
  more fp32 logits copies than this plain loss), and the save and load time of a
  `torch.distributed.checkpoint` of weights and optimizer state (checked by restoring a
  parameter that was zeroed after the save).
The last line of output is one JSON object with every number.

Model FLOPs per token: 6 x (parameters in matmuls: all but the input embedding) plus the
attention's 12 x layers x hidden x seq (PaLM, Chowdhery et al. 2022, appendix B; no causal
halving), so MFU is comparable with other reports.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # miles, when run as a script from a checkout
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
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps (compilation)")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--no-compile", action="store_true", help="eager blocks")
    p.add_argument("--checkpoint-dir", type=Path, default=None,
                   help="where the DCP checkpoint goes (default: a temporary folder, removed)")
    return p.parse_args(argv)


def init_process_group():
    """NCCL over torchrun's environment, or a world of one on this GPU."""
    import torch
    import torch.distributed as dist

    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517"}.items():
        os.environ.setdefault(key, value)
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method="env://", device_id=device)
    return device


def build_model(args, device):
    """The Llama from the arguments on `device` (fp32), blocks compiled, sharded with bf16
    mixed precision; returns (model, config)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama", vocab_size=args.vocab, hidden_size=args.hidden,
        intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(args.seq, 2048), tie_word_embeddings=False)
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    model.config.use_cache = False
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        if not args.no_compile:
            layer.compile()
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model, config


def train(model, optimizer, args, device, steps: int) -> float:
    """`steps` optimizer steps on random tokens; the last loss."""
    import torch

    loss = torch.zeros(())
    for _ in range(steps):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)  # [B, T]
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def checkpoint_round_trip(model, optimizer, folder: Path) -> dict:
    """Save weights + optimizer with DCP, zero one parameter, load, check it came back."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def state():
        weights, optim = get_state_dict(model, optimizer)
        return {"model": weights, "optim": optim}

    torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    dcp.save(state(), checkpoint_id=str(folder))
    dist.barrier()
    save_s = time.perf_counter() - start
    probe = next(model.parameters())
    expected = probe.detach().to_local().clone()
    with torch.no_grad():
        probe.to_local().zero_()
    start = time.perf_counter()
    loaded = state()
    dcp.load(loaded, checkpoint_id=str(folder))
    set_state_dict(model, optimizer, model_state_dict=loaded["model"],
                   optim_state_dict=loaded["optim"])
    torch.cuda.synchronize()
    dist.barrier()
    load_s = time.perf_counter() - start
    ok = torch.equal(probe.detach().to_local(), expected)
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    return {"save_s": round(save_s, 2), "load_s": round(load_s, 2), "restored": ok,
            "checkpoint_gib": round(size / 2**30, 2)}


def checkpoint_folder(given: Path | None) -> Path:
    """`given`, or a temporary folder made by rank 0 whose path every rank receives (one
    node; on several nodes pass a shared `--checkpoint-dir`)."""
    import torch.distributed as dist

    if given is not None:
        return given
    path = [tempfile.mkdtemp(prefix="miles-gpu-check-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)  # a path string between our own ranks
    return Path(path[0])


def memory_estimate(config, args, world: int) -> float:
    """`miles.trainer.memory`'s per-rank estimate (GiB) for this setup: full fine-tuning, bf16,
    no activation checkpointing, no critic or reference."""
    from miles.trainer.memory import GIB, ModelShape, Plan, estimate_memory

    shape = ModelShape.from_hf_config(config.to_dict())
    plan = Plan(lora=None, dtype="bf16", ranks=world, tokens=args.batch * args.seq,
                meta_init=True)
    return estimate_memory(shape, plan).step / GIB


def run(args) -> dict:
    import torch
    import torch.distributed as dist

    device = init_process_group()
    world = dist.get_world_size()
    start = time.perf_counter()
    model, config = build_model(args, device)
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    build_s = time.perf_counter() - start

    start = time.perf_counter()
    first_loss = train(model, optimizer, args, device, args.warmup)
    torch.cuda.synchronize()
    warmup_s = time.perf_counter() - start

    torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    last_loss = train(model, optimizer, args, device, args.steps)
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - start) / args.steps
    peak_bytes = torch.cuda.max_memory_allocated(device)

    tokens_per_s = args.batch * args.seq * world / step_s
    per_token = flops_per_token(matmul_params=params - args.vocab * args.hidden,
                                layers=args.layers, hidden=args.hidden, seq=args.seq)
    name = torch.cuda.get_device_name(device)
    peak = peak_flops(name)
    achieved = tokens_per_s / world * per_token

    folder = checkpoint_folder(args.checkpoint_dir)
    try:
        checkpoint = checkpoint_round_trip(model, optimizer, folder)
    finally:
        dist.barrier()
        if args.checkpoint_dir is None and dist.get_rank() == 0:
            shutil.rmtree(folder, ignore_errors=True)
    fraction = mfu(tokens_per_s / world, per_token, peak)
    return {
        "device": name, "world_size": world, "torch": torch.__version__,
        "parameters": params, "compile": not args.no_compile, "precision": "bf16/fp32-reduce",
        "tokens_per_step": args.batch * args.seq * world,
        "build_s": round(build_s, 1), "warmup_s": round(warmup_s, 1),
        "step_s": round(step_s, 4), "tokens_per_s": round(tokens_per_s),
        "tflops_per_gpu": round(achieved / 1e12, 1),
        "peak_tflops": peak / 1e12 if peak else None,
        "mfu": round(fraction, 3) if fraction is not None else None,
        "peak_memory_gib": round(peak_bytes / 2**30, 2),
        "estimated_memory_gib": round(memory_estimate(config, args, world), 2),
        "loss_first": round(first_loss, 3), "loss_last": round(last_loss, 3),
        **checkpoint,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False, torch "
              f"{torch.__version__}); this check needs an NVIDIA GPU and runs nothing "
              "without one.", file=sys.stderr)
        return NO_CUDA_EXIT
    import torch.distributed as dist

    try:
        result = run(args)
        if dist.get_rank() == 0:
            for key, value in result.items():
                print(f"{key:>22}: {value}")
            print(json.dumps(result))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
