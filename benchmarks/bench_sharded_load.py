"""Peak memory per rank when the trainer starts on two CPU ranks: sharded load vs full load.

Run by hand (not a test), from the repository root:

    python benchmarks/bench_sharded_load.py [--hidden 2048] [--layers 22] [--intermediate 5632]
        [--modes sharded,full] [--activation-checkpointing] [--precision fp32]
        [--mmap-threshold BYTES]

Builds a Llama-style model from a config (default: TinyLlama-1.1B's shape, vocab 32,000,
~1.1B parameters, 4.1 GiB in fp32), saves it with `save_pretrained`, then for each mode starts
`torchrun --nproc_per_node 2` workers that build the real `Learner` (LoRA r=16, gloo) with
`learner.sharded_load` on or off, take one GRPO step on a small batch, and report each rank's
peak anonymous memory (`RssAnon`, sampled) and peak resident set (`VmHWM`, which also counts
the memory-mapped checkpoint's page cache) after loading and after the step, GiB = 2**30 bytes.
`--activation-checkpointing` and `--precision` set the learner options of those names
(`--precision bf16`: weights gathered and computed in bf16, kept in fp32). `--mmap-threshold`
sets glibc's `MALLOC_MMAP_THRESHOLD_` in the workers' environment (an allocator setting, not a
code change): by default glibc raises that threshold up to 32 MiB as large blocks are freed, so
freed tensors below it stay in the heap and in `RssAnon`; with a fixed small threshold each
tensor is its own mapping, returned to the kernel when freed, and `RssAnon` follows live memory.
Target (issue 7): with the sharded load, no rank holds the full weights: every rank's peak
< 0.7x the model's fp32 size. Results in `docs/benchmarks.md`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30


def status_gib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 2**20
    return float("nan")


class AnonPeak:
    """Highest anonymous resident memory (`RssAnon`, sampled every 5 ms in a thread): the
    process's own memory, without the page cache of memory-mapped checkpoint files, which
    `VmHWM` counts although it is shared by the ranks and reclaimable."""

    def __init__(self):
        import threading

        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, status_gib("RssAnon"))

    def read(self) -> float:
        self.peak = max(self.peak, status_gib("RssAnon"))
        return self.peak


def build(out: Path, hidden: int, layers: int, intermediate: int) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from miles.tasks.tiny_model import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    config = AutoConfig.for_model("llama", vocab_size=32000, hidden_size=hidden,
                                  intermediate_size=intermediate, num_hidden_layers=layers,
                                  num_attention_heads=hidden // 64, num_key_value_heads=4,
                                  max_position_embeddings=256, tie_word_embeddings=False,
                                  bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def worker(model_dir: str, sharded: bool, checkpointing: bool, precision: str) -> None:
    import torch

    from miles.trainer import distributed
    from miles.trainer.learner import Learner, LearnerConfig
    from miles.trainer.model import LoraSettings
    from tests.factories import make_group

    anon = AnonPeak()
    config = LearnerConfig(lr=1e-4, sharded_load=sharded,
                           activation_checkpointing=checkpointing, precision=precision)
    learner = Learner(model_dir, config, lora=LoraSettings(r=16, alpha=32))
    loaded = [anon.read(), status_gib("VmHWM")]
    learner.train_step([make_group(4, 16, prompt_tokens=16, vocab_size=78, seed=s)
                        for s in range(4)])
    mine = torch.tensor(loaded + [anon.read(), status_gib("VmHWM")], dtype=torch.float64)
    gathered = [torch.zeros(4, dtype=torch.float64) for _ in range(distributed.world_size())]
    torch.distributed.all_gather(gathered, mine)
    if distributed.is_main():
        keys = ("load_anon_peak", "load_hwm", "step_anon_peak", "step_hwm")
        ranks = [dict(zip(keys, (round(v, 2) for v in g.tolist()))) for g in gathered]
        print(json.dumps({"sharded": sharded, "activation_checkpointing": checkpointing,
                          "precision": precision,
                          "mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
                          "per_rank_gib": ranks}))
    distributed.barrier()
    distributed.destroy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--modes", default="sharded,full",
                        help="comma-separated: sharded (learner.sharded_load), full, or both")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="learner.activation_checkpointing on")
    parser.add_argument("--precision", default="fp32", help="learner.precision")
    parser.add_argument("--mmap-threshold", type=int,
                        help="MALLOC_MMAP_THRESHOLD_ for the workers (glibc; bytes)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--sharded", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.sharded, args.activation_checkpointing, args.precision)
        return
    modes = args.modes.split(",")
    if not modes or set(modes) - {"sharded", "full"}:
        parser.error(f"--modes takes sharded and/or full, got {args.modes!r}")
    with tempfile.TemporaryDirectory(prefix="bench-sharded-") as tmp:
        params = build(Path(tmp), args.hidden, args.layers, args.intermediate)
        full = params * 4 / GIB
        print(f"model: {params / 1e9:.2f}B parameters, {full:.2f} GiB in fp32; "
              f"target per-rank peak < {0.7 * full:.2f} GiB")
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        if args.mmap_threshold is not None:
            env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
        for mode in modes:
            sharded = mode == "sharded"
            done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                   "--nproc_per_node=2", __file__, "--worker", tmp]
                                  + (["--sharded"] if sharded else [])
                                  + (["--activation-checkpointing"]
                                     if args.activation_checkpointing else [])
                                  + ["--precision", args.precision],
                                  env=env, capture_output=True, text=True)
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            print(lines[-1] if lines else f"sharded={sharded} failed:\n{done.stderr[-2000:]}")


if __name__ == "__main__":
    main()
