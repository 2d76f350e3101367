"""Held-out accuracy over wall time, measured after a run from the policies it produced.

Both sides of `benchmarks/vs_trl.py` keep every policy version with the second of RL it was
made at (Miles: its weight store, `keep_versions=0`, and `metrics.jsonl`; TRL: an adapter copy
at each step's end). After the run, this module evaluates the newest version at each point of a
fixed grid (every second for the first 30 s, then every 5 s), with Miles' greedy evaluation
(`miles.evaluation.greedy_accuracy`: HF engine, greedy, 8 new tokens, `exact_match`) on all
1,000 held-out problems. Evaluating afterwards takes no time or cores from either run and
resolves "time to +25 points" to a second, where an evaluator running every 10 s during the run
could only say "by the first point" for both sides.

    python benchmarks/heldout_curve.py --model-dir WARM --run-dir RUN

(the Miles side: RUN is a `miles demo` output folder; writes RUN/heldout_curve.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

DENSE_S = 30  # one point a second up to here
SPARSE_EVERY_S = 5  # then one every 5 s


def grid(seconds: float) -> list[float]:
    """The curve's points in seconds of RL: 1..30 each second, then every 5 s to `seconds`."""
    points = [float(t) for t in range(1, min(DENSE_S, int(seconds)) + 1)]
    t = DENSE_S + SPARSE_EVERY_S
    while t <= seconds:
        points.append(float(t))
        t += SPARSE_EVERY_S
    return points


def newest_at(snapshots: list[tuple[float, int]], points: list[float]) -> list[tuple[float, int]]:
    """(point, version) for each grid point: the newest snapshot `(seconds, version)` made at or
    before it; points before the first snapshot are left out."""
    ordered = sorted(snapshots)
    out, i, newest = [], 0, None
    for point in points:
        while i < len(ordered) and ordered[i][0] <= point:
            newest = ordered[i][1]
            i += 1
        if newest is not None:
            out.append((point, newest))
    return out


def evaluate(engine, chosen: list[tuple[float, int]], folder_of, fmt: str,
             problems) -> list[dict]:
    """The curve: each distinct version in `chosen` loaded once (`folder_of(version)`: its
    weight folder) and measured on `problems`."""
    from miles.evaluation import greedy_accuracy

    accuracy: dict[int, float] = {}
    curve = []
    for point, version in chosen:
        if version not in accuracy:
            engine.load_version(folder_of(version), version, fmt)
            accuracy[version] = asyncio.run(greedy_accuracy(engine, problems))
        curve.append({"seconds": point, "policy_version": version,
                      "accuracy": accuracy[version]})
    return curve


def miles_snapshots(run_dir: Path) -> list[tuple[float, int]]:
    """(seconds of RL, policy version) of each version a Miles run wrote, from its metrics and
    the report's clock start."""
    started = json.loads((run_dir / "report.json").read_text())["rl_started_at"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if line]
    return [(row["time"] - started, int(row["trainer/policy_version"])) for row in rows
            if "trainer/policy_version" in row]


def miles_curve(model_dir: Path, run_dir: Path) -> dict:
    """The curve of a Miles run's kept versions (LoRA of the shape they were written with, or
    full weights)."""
    from miles.engines.base import LoraSettings
    from miles.engines.hf import HFEngine
    from miles.tasks.datasets import load_problems

    report = json.loads((run_dir / "report.json").read_text())
    chosen = newest_at(miles_snapshots(run_dir), grid(report["rl_seconds"]))
    folder = lambda v: run_dir / "weights" / f"v{v:08d}"  # noqa: E731
    config = folder(chosen[0][1]) / "adapter_config.json" if chosen else None
    lora = None
    if config is not None and config.is_file():
        written = json.loads(config.read_text())
        lora = LoraSettings(r=written["r"], alpha=written["lora_alpha"],
                            target_modules=tuple(sorted(written["target_modules"])))
    engine = HFEngine(model_dir, lora=lora)
    curve = evaluate(engine, chosen, folder, "full" if lora is None else "lora",
                     load_problems("arithmetic", "test"))
    return {"curve": curve, "problems": 1000}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, required=True, help="the warm start")
    parser.add_argument("--run-dir", type=Path, required=True, help="a miles demo's out dir")
    args = parser.parse_args(argv)
    result = miles_curve(args.model_dir, args.run_dir)
    (args.run_dir / "heldout_curve.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
