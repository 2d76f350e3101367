"""Step time and peak memory of the learner's switches: sequence packing, bf16, torch.compile and
activation checkpointing.

Run by hand (not a test), from the repository root:

    python benchmarks/bench_learner_options.py [--hidden 512] [--layers 8] [--lora]

A Llama-style model from `build_tiny_model` (character vocabulary, tied embeddings; default
hidden 512, 8 layers, ~25M parameters), full fine-tuning unless `--lora`; one `train_step` on 8
groups x 8 samples of 16 prompt + 8..40 response tokens (ragged, as RL responses are:
2,547 tokens, 3,584 padded). "eager" is the default learner (packed sequences, fp32 on a CPU);
"padded" turns packing off, "bf16" computes in bf16 (slow on CPUs without bf16 matrix units,
measured for completeness), "compile" and "checkpointing" are each one switch on top of
eager; "epochs2" / "epochs4" (`ppo_epochs`) and "minibatch4" (`mini_batches`) make several
optimizer updates per batch (one no-grad proximal scoring pass, then one forward + backward of
every group per epoch). Each mode runs in its own
process: 3 warm-up steps (compilation happens there), then the median of 5 timed steps; peak
memory is the process's resident high-water mark over the timed steps (`VmHWM` after resetting
it with `/proc/self/clear_refs`), GiB = 2**30 bytes. Wall time on a shared CPU: indicative.
Results in `docs/benchmarks.md`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = {"eager": {}, "padded": {"sequence_packing": False}, "bf16": {"precision": "bf16"},
         "compile": {"compile": True}, "checkpointing": {"activation_checkpointing": True},
         # several optimizer updates per batch (GRPO estimator): ppo_epochs x mini_batches
         "epochs2": {"ppo_epochs": 2}, "epochs4": {"ppo_epochs": 4},
         "minibatch4": {"mini_batches": 4}}
SCHEDULE = ("ppo_epochs", "mini_batches")  # mode keys that go to the algorithm config


def peak_gib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def child(mode: str, model_dir: str, lora: bool) -> dict:
    import torch

    from miles.trainer import distributed
    from miles.trainer.learner import Learner, LearnerConfig
    from miles.trainer.model import LoraSettings
    from tests.factories import make_group, make_sample

    from miles.rl.algorithm import AlgorithmConfig

    torch.set_num_threads(2)
    options = {k: v for k, v in MODES[mode].items() if k not in SCHEDULE}
    schedule = {k: v for k, v in MODES[mode].items() if k in SCHEDULE}
    learner = Learner(model_dir, LearnerConfig(lr=1e-4, algorithm=AlgorithmConfig(**schedule),
                                               **options),
                      lora=LoraSettings(r=16, alpha=32) if lora else None)
    groups = [make_group(prompt_tokens=16, vocab_size=78, seed=s, samples=[
        make_sample(8 + (s * 8 + i) * 7 % 33, vocab_size=78, seed=s * 8 + i) for i in range(8)])
        for s in range(8)]
    for _ in range(3):
        learner.train_step(groups)
    Path("/proc/self/clear_refs").write_text("5")
    times = []
    for _ in range(5):
        began = time.perf_counter()
        learner.train_step(groups)
        times.append(time.perf_counter() - began)
    distributed.destroy()
    return {"mode": mode, "step_s": round(statistics.median(times), 3),
            "peak_gib": round(peak_gib(), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.model_dir, args.lora)))
        return
    from miles.tasks.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="bench-options-") as tmp:
        model_dir = build_tiny_model(Path(tmp), hidden_size=args.hidden, layers=args.layers,
                                     heads=8, kv_heads=4, max_positions=64)
        results = []
        for mode in args.modes:
            done = subprocess.run([sys.executable, __file__, "--child", mode, "--model-dir",
                                   str(model_dir)] + (["--lora"] if args.lora else []),
                                  capture_output=True, text=True,
                                  env={**os.environ, "PYTHONPATH": str(REPO)})
            if done.returncode != 0:
                raise SystemExit(f"{mode} failed:\n{done.stderr[-3000:]}")
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    eager = results[0]["step_s"]
    print(f"hidden {args.hidden}, {args.layers} layers, {'LoRA r=16' if args.lora else 'full'}")
    for r in results:
        print(f"{r['mode']:<14} step {r['step_s']:.3f} s ({eager / r['step_s']:.2f}x eager), "
              f"peak {r['peak_gib']:.2f} GiB")


if __name__ == "__main__":
    main()
