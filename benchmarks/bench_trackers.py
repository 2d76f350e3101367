"""Trainer step time with and without the experiment trackers (`trackers.report_to`).

Run by hand (not a test), from the repository root:

    python benchmarks/bench_trackers.py [--steps 40] [--rounds 2] [--modes none all]

The real trainer loop (`TrainerLoop`, embedded bus) on the demo's shape: the demo's tiny model
(hidden 128, 4 layers, LoRA r=16), 32 groups per step of 8 samples x 5 tokens, published
before the trainer starts so the step is the trainer's alone. Modes: `none`; `tensorboard`,
`wandb` (offline), `mlflow` (its SQLite store in the run's folder) each alone; `all` three
at once. Every tracker mode also writes a sample table every 10 steps (`samples_every=10`,
16 rows), as a user who asks for tables would. Each mode runs in its own process, the modes
in turn `--rounds` times (a shared machine drifts; alternating spreads it over all modes).

Two numbers per mode: the median wall time between consecutive steps (metrics.jsonl's `time`,
steps after the first 5: everything the loop does per step, the trackers included), and the
time spent inside the tracker calls per step (log and sample tables, measured around them),
which is the trackers' whole cost to the loop (their files are written by their own threads
and processes). Results in `docs/benchmarks.md`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = {"none": (), "tensorboard": ("tensorboard",), "wandb": ("wandb",),
         "mlflow": ("mlflow",), "all": ("tensorboard", "wandb", "mlflow")}
WARM_UP = 5
GROUPS_PER_STEP = 32


def demo_groups(count: int) -> list:
    """Groups of the demo's shape: 8 samples of 5 tokens, version 0, ids in the tokenizer's."""
    import numpy as np

    from tests.factories import make_group

    groups = []
    for seed in range(count):
        group = make_group(8, 5, prompt_tokens=10, vocab_size=70, policy_version=0, seed=seed,
                           group_id=f"group-{seed:05d}")
        samples = [replace(s, versions=np.zeros_like(s.versions)) for s in group.samples]
        groups.append(replace(group, vocab_size=78, samples=samples))
    return groups


class Timed:
    """Wraps a `Trackers`, adding up the seconds spent in its calls."""

    def __init__(self, trackers):
        self.trackers, self.seconds = trackers, 0.0
        self.settings = trackers.settings

    def __getattr__(self, name):
        method = getattr(self.trackers, name)

        def timed(*args, **kwargs):
            began = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - began

        return timed


async def child_run(mode: str, model_dir: Path, out: Path, steps: int) -> dict:
    from miles.bus import open_bus
    from miles.engines.base import LoraSettings
    from miles.protocol import encode
    from miles.protocol.topics import run_topics, topic_name
    from miles.trackers import TrackerSettings, open_trackers
    from miles.trainer.learner import Learner, LearnerConfig
    from miles.trainer.loop import LoopConfig, TrainerLoop
    from miles.trainer.runner import StepRunner

    settings = TrackerSettings(report_to=MODES[mode], samples_every=10 if MODES[mode] else 0)
    config = LoopConfig(run="bench", out_dir=out, groups_per_step=GROUPS_PER_STEP,
                        max_steps=steps, max_staleness=10_000, checkpoint_every=0)
    async with open_bus("embedded://") as bus:
        await bus.create_topics(run_topics("bench", trajectory_partitions=1))
        for group in demo_groups(GROUPS_PER_STEP * steps):
            await bus.publish(topic_name("bench", "trajectories"), encode(group))
        learner = Learner(model_dir, LearnerConfig(lr=1e-3), lora=LoraSettings(r=16, alpha=32))
        with open_trackers(settings, role="trainer", run="bench", default_dir=out / "trackers",
                           config=config) as trackers:
            timed = Timed(trackers)
            loop = TrainerLoop(bus, StepRunner(learner, config, base_model=str(model_dir)),
                               timed)
            await loop.run(asyncio.Event())
    stamps = [json.loads(line)["time"] for line in (out / "metrics.jsonl").read_text()
              .splitlines()]
    gaps = [b - a for a, b in zip(stamps[WARM_UP:], stamps[WARM_UP + 1:])]
    return {"mode": mode, "step_s": statistics.median(gaps),
            "tracker_ms_per_step": 1000 * timed.seconds / steps}


def child(mode: str, model_dir: str, steps: int) -> dict:
    import torch

    from miles.trainer import distributed

    torch.set_num_threads(2)
    os.environ.setdefault("WANDB_MODE", "offline")
    with tempfile.TemporaryDirectory(prefix=f"bench-trackers-{mode}-") as tmp:
        os.environ.setdefault("WANDB_DATA_DIR", tmp)  # W&B's staging, not the user's
        result = asyncio.run(child_run(mode, Path(model_dir), Path(tmp), steps))
    distributed.destroy()
    return result


def run_child(mode: str, model_dir: Path, steps: int) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", mode, "--model-dir",
                           str(model_dir), "--steps", str(steps)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    if done.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.model_dir, args.steps)))
        return
    from miles.tasks.tiny_model import build_tiny_model

    results: dict[str, list[dict]] = {mode: [] for mode in args.modes}
    with tempfile.TemporaryDirectory(prefix="bench-trackers-") as tmp:
        model_dir = build_tiny_model(Path(tmp))  # the demo's model
        for _ in range(args.rounds):
            for mode in args.modes:
                results[mode].append(run_child(mode, model_dir, args.steps))
    base = statistics.median(r["step_s"] for r in results[args.modes[0]])
    print(f"{args.steps} steps x {args.rounds} rounds, {GROUPS_PER_STEP} groups of 8 x 5 tokens")
    for mode, runs in results.items():
        step = statistics.median(r["step_s"] for r in runs)
        spent = statistics.median(r["tracker_ms_per_step"] for r in runs)
        each = ", ".join(f"{r['step_s']:.3f}" for r in runs)
        print(f"{mode:<12} step {step:.3f} s ({(step / base - 1) * 100:+.1f}% vs "
              f"{args.modes[0]}; rounds: {each}), in tracker calls {spent:.2f} ms/step")


if __name__ == "__main__":
    main()
