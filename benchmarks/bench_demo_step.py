"""The learner's train step alone on the demo's model and batch shape, one thread.

Run by hand (not a test), from the repository root:

    python benchmarks/bench_demo_step.py [--steps 40] [--model-dir WARM] [--profile]

The model is the demo's warm start (`miles.warm_start.warm_start(DemoConfig())`: built and
cached on first use, ~1 min; or `--model-dir`), with the demo's learner settings (`RunConfig`:
LoRA r=16, lr 1e-3, `precision=auto`). Each batch is 32 groups x 8 samples of a 6-token prompt
and 1-5 response tokens (the demo's shape), about 30% of the groups with equal rewards (their
samples are skipped, as in a run); four batches in turn. Prints the median and minimum of
`--steps` timed steps after 5 warm-up steps; `--profile` adds torch's profiler table of 5 more.
Results in docs/benchmarks.md ("Attention kernels").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from miles.demo import DemoConfig  # noqa: E402
from miles.trainer import distributed  # noqa: E402
from miles.trainer.learner import Learner  # noqa: E402
from miles.warm_start import warm_start  # noqa: E402
from tests.factories import make_group, make_sample  # noqa: E402

GROUPS, SAMPLES, PROMPT, VOCAB = 32, 8, 6, 30


def demo_batch(seed: int) -> list:
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(GROUPS):
        equal = rng.random() < 0.3
        samples = [make_sample(int(rng.integers(1, 6)), vocab_size=VOCAB, policy_version=0,
                               seed=seed * 1000 + g * SAMPLES + i,
                               reward=0.0 if equal else float(rng.integers(0, 2)))
                   for i in range(SAMPLES)]
        groups.append(make_group(prompt_tokens=PROMPT, vocab_size=VOCAB, samples=samples,
                                 seed=seed * 100 + g, policy_version=0))
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--model-dir", type=Path)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    demo = DemoConfig()
    model_dir = args.model_dir or warm_start(demo)
    learner = Learner(model_dir, demo.learner, lora=demo.lora)
    batches = [demo_batch(seed) for seed in range(4)]
    for i in range(5):
        learner.train_step(batches[i % 4])
    times = []
    for i in range(args.steps):
        start = time.perf_counter()
        learner.train_step(batches[i % 4])
        times.append(time.perf_counter() - start)
    print(f"step median {statistics.median(times) * 1e3:.1f} ms, min {min(times) * 1e3:.1f} ms "
          f"({args.steps} steps, {learner.config.precision} -> {learner.dtype})")
    if args.profile:
        from torch.profiler import profile
        with profile() as prof:
            for i in range(5):
                learner.train_step(batches[i % 4])
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    distributed.destroy()


if __name__ == "__main__":
    main()
