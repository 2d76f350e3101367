"""Async against sync: the same Kafka demo run with `max_staleness=0` (the producer waits for
each new version before generating the next step's groups) and with `max_staleness=2`
(generation of the next steps overlaps training), producer and trainer as separate processes
with one torch thread each.

    miles broker start --port 29092 --data-dir /tmp/exp/broker
    PYTHONPATH=$PWD python3 benchmarks/bench_async.py --bus kafka://127.0.0.1:29092 \
        [--rl-seconds 180] [--staleness 0,2] [--out runs/bench-async] [--set KEY=VALUE ...]

Each run is `miles demo` (warm start cached, so both start from the same policy); `--set`
passes demo settings to both runs (the workload: see docs/benchmarks.md for the one measured
and why). Per run: optimizer steps, RL seconds, steps/s, the fractions of RL time generating
and training, held-out accuracy at the end, and held-out accuracy by policy version (the
evaluator's curve), so accuracy per step can be compared. The ratio of steps/s to the first
staleness is printed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np


def run_demo(bus: str, staleness: int, rl_seconds: float, out: Path, sets: list[str]) -> dict:
    args = [sys.executable, "-m", "miles.cli", "demo", "--bus", bus, "--rl-seconds",
            str(rl_seconds), "--out", str(out), "--max-staleness", str(staleness)]
    for item in sets:
        args += ["--set", item]
    subprocess.run(args, check=True)
    return json.loads((out / "report.json").read_text())


def by_version(report: dict) -> dict[int, float]:
    """Held-out accuracy by policy version (the last measurement of each)."""
    return {int(p["policy_version"]): p["accuracy"] for p in report["curve"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bus", required=True, help="kafka://HOST:PORT of a running broker")
    parser.add_argument("--rl-seconds", type=float, default=180.0)
    parser.add_argument("--staleness", default="0,2")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-async"))
    parser.add_argument("--set", dest="sets", action="append", default=[])
    args = parser.parse_args()
    rows = []
    for staleness in (int(s) for s in args.staleness.split(",")):
        report = run_demo(args.bus, staleness, args.rl_seconds,
                          args.out / f"staleness-{staleness}", args.sets)
        rows.append({"max_staleness": staleness, "steps": report["steps"],
                     "rl_seconds": report["rl_seconds"],
                     "steps_per_s": report["steps"] / report["rl_seconds"],
                     "fraction_generating": report["fraction_generating"],
                     "fraction_training": report["fraction_training"],
                     "initial_accuracy": report["initial_accuracy"],
                     "final_accuracy": report["final_accuracy"],
                     "max_lag_seen": report["max_lag_seen"],
                     "accuracy_by_version": by_version(report)})
        print(json.dumps(rows[-1]), flush=True)
    (args.out / "async.json").write_text(json.dumps(rows, indent=2))
    print("| max_staleness | steps | RL s | steps/s | generating | training | accuracy | "
          "max lag |\n| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['max_staleness']} | {r['steps']} | {r['rl_seconds']:.0f} | "
              f"{r['steps_per_s']:.3f} | {r['fraction_generating']:.2f} | "
              f"{r['fraction_training']:.2f} | {r['initial_accuracy']:.3f} -> "
              f"{r['final_accuracy']:.3f} | {r['max_lag_seen']} |")
    for r in rows[1:]:
        print(f"steps/s, staleness {r['max_staleness']} / {rows[0]['max_staleness']}: "
              f"{r['steps_per_s'] / rows[0]['steps_per_s']:.2f}x")
    first = rows[0]["accuracy_by_version"]
    for r in rows[1:]:  # the curves are measured at different versions: interpolate
        pairs = [(v, a, np.interp(v, list(r["accuracy_by_version"]),
                                  list(r["accuracy_by_version"].values())))
                 for v, a in first.items() if min(r["accuracy_by_version"]) <= v
                 <= max(r["accuracy_by_version"])]
        print(f"held-out accuracy by version, staleness {rows[0]['max_staleness']} vs "
              f"{r['max_staleness']} (interpolated): "
              + ", ".join(f"v{v} {a:.3f}/{b:.3f}" for v, a, b in pairs))

if __name__ == "__main__":
    main()
