"""Miles' levers on the `vs_trl` benchmark: each one changed alone from the defaults.

    python3 benchmarks/vs_trl_ablation.py --seeds 1 --seconds 30 --out runs/vs-trl-ablation \
        [--levers defaults,fp32,...]

Each lever is a `benchmarks/vs_trl.py` run of the Miles side (embedded bus unless the lever is
the Kafka bus) with one setting changed (`--set`), the runs in the order of `LEVERS`, one after
the other; every curve is measured after its run (`heldout_curve`). Per lever (median over
seeds): seconds to warm start + 25 points, held-out accuracy at 10 s and at the end (all 1,000
problems), steps/s and trainer tokens/s. Writes OUT/ablation.md and OUT/ablation.json; each
lever's runs stay in OUT/LEVER.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CORES = len(os.sched_getaffinity(0))
LEVERS: dict[str, tuple[str, list[str]]] = {  # name: (side, Miles settings)
    "defaults": ("miles", []),
    "before-issue-21": ("miles", ["learner.precision=fp32", "eval_every_s=10",
                                  "eval_after_run=false", "learner_process=false",
                                  "learner.skip_zero_advantage=false",
                                  "learner.share_prompts=false", f"torch_threads={CORES}"]),
    # the demo's defaults before: every setting made default since that a run can switch off
    # (kernels, fused AdamW, the merged adapter and the codec's speed-ups stay)
    "fp32": ("miles", ["learner.precision=fp32"]),
    "kafka-processes": ("miles-kafka", []),  # producer and trainer processes, a core each
    "learner-in-process": ("miles", ["learner_process=false"]),  # the learner in the run's
    # process (a thread), sharing its GIL with the event loop and the engine
    "threads-2-each": ("miles", ["torch_threads=2"]),  # engine and learner each on torch's
    # default pool of both cores, in one process (the default before torch_threads)
    "synchronous": ("miles", ["max_staleness=0"]),
    # on-policy, the engine and the learner taking turns, each on every core
    "synchronous-all-cores": ("miles", ["max_staleness=0", f"torch_threads={CORES}"]),
    "staleness-2": ("miles", ["max_staleness=2"]),
    "eval-in-run": ("miles", ["eval_every_s=10", "eval_after_run=false"]),  # the evaluator
    # measuring during the run, on the critical path (the demo's default until issue 21)
    "ppo-epochs-2": ("miles", ["learner.algorithm.ppo_epochs=2"]),  # updates per batch
    "groups-16": ("miles", ["groups_per_step=16"]),
    "groups-64": ("miles", ["groups_per_step=64"]),
    "samples-4": ("miles", ["sampling.n=4"]),
    "samples-16": ("miles", ["sampling.n=16"]),
    "mini-batches-2": ("miles", ["learner.algorithm.mini_batches=2"]),  # two updates per batch,
    # each on half its groups: the same compute, twice the updates
    "lr-5e-4": ("miles", ["learner.lr=5e-4"]),
    "lr-1.5e-3": ("miles", ["learner.lr=1.5e-3"]),
    "adam-beta2-0.99": ("miles", ["learner.betas=0.9,0.99"]),  # a shorter second-moment memory
    "lora-plus-4": ("miles", ["learner.lora_plus_ratio=4"]),  # LoRA+: B at 4x the rate
    "lora-plus-16": ("miles", ["learner.lora_plus_ratio=16"]),
    "lr-2e-3": ("miles", ["learner.lr=2e-3"]),
    "lora-r64": ("miles", ["lora.r=64", "lora.alpha=128"]),  # the same alpha / r
    "full-finetune": ("miles", ["lora=none", "learner.lr=1e-4"]),
    "full-finetune-2e-4": ("miles", ["lora=none", "learner.lr=2e-4"]),
    "full-finetune-4e-4": ("miles", ["lora=none", "learner.lr=4e-4"]),
    "full-finetune-6e-4": ("miles", ["lora=none", "learner.lr=6e-4"]),
    "padded": ("miles", ["learner.sequence_packing=false"]),
    "train-zero-advantage": ("miles", ["learner.skip_zero_advantage=false"]),  # equal-reward
    # groups forwarded and backpropagated for terms that are exactly 0
    "separate-prompts": ("miles", ["learner.share_prompts=false"]),  # a copy of the prompt per
    # sample instead of one per group
    "compile": ("miles", ["learner.compile=true"]),
    "dynamic-sampling": ("miles", ["learner.algorithm.dynamic_sampling=true"]),  # DAPO's: only
    # groups with unequal rewards fill a step (the producer, idle half the time, makes more)
}


def accuracy_at(curve: list[dict], seconds: float) -> float | None:
    """The curve's accuracy at its last point at or before `seconds`."""
    points = [p for p in curve if p["seconds"] <= seconds]
    return points[-1]["accuracy"] if points else None


def lever_row(name: str, runs: list[dict]) -> dict:
    def median(values):
        numbers = [v for v in values if v is not None]
        return statistics.median(numbers) if numbers else None

    return {"lever": name, "settings": LEVERS[name][1], "side": LEVERS[name][0],
            "runs": len(runs),
            "seconds_to_plus_25": [r["seconds_to_plus_25"] for r in runs],
            "accuracy_at_10s": median(accuracy_at(r["curve"], 10.0) for r in runs),
            "final_accuracy": median(r["final_accuracy"] for r in runs),
            "steps_per_s": median(r["steps_per_s"] for r in runs),
            "trainer_tokens_per_s": median(r["trainer_tokens_per_s"] for r in runs)}


def table(rows: list[dict]) -> str:
    def num(value, digits):
        return "-" if value is None else f"{value:.{digits}f}"

    lines = ["| lever | settings | +25 at (s), per seed | acc @10 s | final | steps/s | "
             "trainer tok/s |", "|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        reached = ", ".join("never" if s is None else f"{s:.0f}"
                            for s in r["seconds_to_plus_25"])
        settings = " ".join(f"`{s}`" for s in r["settings"]) or (
            "bus Kafka" if r["side"] == "miles-kafka" else "-")
        lines.append(f"| {r['lever']} | {settings} | {reached} | "
                     f"{num(r['accuracy_at_10s'], 3)} | {num(r['final_accuracy'], 3)} | "
                     f"{num(r['steps_per_s'], 2)} | {num(r['trainer_tokens_per_s'], 0)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--out", type=Path, default=Path("runs/vs-trl-ablation"))
    parser.add_argument("--levers", default=",".join(LEVERS))
    args = parser.parse_args(argv)
    names = [n for n in args.levers.split(",") if n]
    unknown = set(names) - set(LEVERS)
    if unknown:
        parser.error(f"unknown levers {sorted(unknown)}; choose from {', '.join(LEVERS)}")
    out = args.out.resolve()
    rows = []
    for name in names:
        side, settings = LEVERS[name]
        command = [sys.executable, str(REPO / "benchmarks" / "vs_trl.py"), "--seeds",
                   str(args.seeds), "--seconds", str(args.seconds), "--sides", side,
                   "--out", str(out / name)]
        for item in settings:
            command += ["--set", item]
        print(f"[ablation] {name}: {' '.join(settings) or side}", flush=True)
        shutil.rmtree(out / name / "runs", ignore_errors=True)  # no earlier run's seeds
        subprocess.run(command, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
        runs = [json.loads(p.read_text()) for p in sorted((out / name / "runs").glob("*.json"))
                if not p.name.endswith(".trl.json")]
        rows.append(lever_row(name, runs))
        (out / "ablation.json").write_text(json.dumps(rows, indent=2))
        (out / "ablation.md").write_text(table(rows) + "\n")
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
