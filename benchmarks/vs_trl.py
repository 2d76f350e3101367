"""Miles against TRL's `GRPOTrainer` on the demo's task: held-out accuracy over wall time.

    python3 scripts/trl_env.py                # once: the TRL environment (~/.cache/miles/trl-env)
    python3 benchmarks/vs_trl.py --seeds 3 [--first-seed 0] --seconds 120 \
        --sides miles,miles-kafka,trl --out runs/vs-trl [--bus kafka://HOST:PORT] [--cpus 0,1] \
        [--trl-set KEY=VALUE ...]

Every run is a subprocess of the TRL environment's python (`--python`), so all sides run the
same torch and transformers. The runs are interleaved, seed by seed and side by side (seed 0:
miles, miles-kafka, trl; seed 1: ...), so drift of a shared machine hits every side alike. Each
side starts from the same warm start (the demo's cached supervised checkpoint, built once
before the first run) with the same budget of RL wall-clock seconds:

- `miles`: `miles demo --model-dir WARM --rl-seconds S --set seed=K --set learner.seed=K
  --set eval_every_s=0 --set keep_versions=0` (embedded bus: producer and trainer in one
  process).
- `miles-kafka`: the same with `--bus kafka://...` (producer and trainer as processes, one
  torch thread each); a broker is started in OUT/broker unless `--bus` names one.
- `trl`: `benchmarks/trl_side.py` (its docstring lists every setting and why).

Held-out accuracy is measured the same way on every side, after the run (`heldout_curve`):
every policy version is kept with the second of RL it was made at, and the newest one at each
second (each 5 s after 30 s) is measured with Miles' greedy evaluation on all 1,000 test
problems, so no evaluation runs during training on either side. Per run
(OUT/runs/SIDE-seedK.json): the curve, seconds to warm start + 25 points (on the curve), final
accuracy, steps, trainer tokens/s (response tokens trained per second of trainer step) and
producer tokens/s (response tokens generated per second of generation), the load average
before the run. OUT/summary.md has the median and range per side; OUT/accuracy.png the curves,
one line per run, a colour per side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SIDES = ("miles", "miles-kafka", "trl")
TRL_PYTHON = Path(os.environ.get("MILES_TRL_ENV", Path.home() / ".cache/miles/trl-env")) / \
    "bin" / "python"
TARGET_GAIN = 0.25  # the "+25 points" over the warm start
COLOURS = {"miles": "tab:blue", "miles-kafka": "tab:green", "trl": "tab:red"}
MILES_MEASURED = ("--set", "eval_every_s=0", "--set", "keep_versions=0")  # no evaluation during
# the run (its curve is measured afterwards from every version kept: `heldout_curve`)
METRICS = ("seconds_to_plus_25", "final_accuracy", "gain", "steps", "steps_per_s",
           "trainer_tokens_per_s", "producer_tokens_per_s")


# -- pure logic (tested in the main environment) ------------------------------------------------

def schedule(seeds: list[int], sides: list[str]) -> list[tuple[int, str]]:
    """The runs in order: every side for one seed before the next seed (A B A B)."""
    return [(seed, side) for seed in seeds for side in sides]


def seconds_to_target(curve: list[dict], initial: float, gain: float = TARGET_GAIN) -> float | None:
    """The first curve point's seconds at or above `initial + gain` (None: never reached)."""
    return next((p["seconds"] for p in curve if p["accuracy"] >= initial + gain - 1e-12), None)


def median_range(values: list[float | None]) -> dict:
    """Median, min and max of `values`, None counting as "never" (above every number): the
    median is None when half or more never happened. `reached` counts the numbers."""
    numbers = sorted(v for v in values if v is not None)
    ordered = numbers + [float("inf")] * (len(values) - len(numbers))
    if not ordered:
        return {"median": None, "min": None, "max": None, "reached": 0, "runs": 0}
    median = statistics.median(ordered)
    return {"median": None if median == float("inf") else median,
            "min": numbers[0] if numbers else None,
            "max": None if len(numbers) < len(values) else numbers[-1],
            "reached": len(numbers), "runs": len(values)}


def summarise(runs: list[dict]) -> dict[str, dict[str, dict]]:
    """Per side (in first-run order), `median_range` of each of `METRICS`."""
    sides = list(dict.fromkeys(run["side"] for run in runs))
    return {side: {metric: median_range([run.get(metric) for run in runs
                                         if run["side"] == side])
                   for metric in METRICS} for side in sides}


def _cell(stats: dict, digits: int) -> str:
    def show(value):
        return "never" if value is None else f"{value:.{digits}f}"

    if stats["runs"] == 0:
        return "-"
    text = f"{show(stats['median'])} ({show(stats['min'])}-{show(stats['max'])})"
    if stats["reached"] < stats["runs"]:
        text += f", {stats['reached']}/{stats['runs']} reached"
    return text


def summary_table(summary: dict[str, dict[str, dict]]) -> str:
    """The summary as a markdown table: median (min-max) per side."""
    digits = {"seconds_to_plus_25": 1, "final_accuracy": 3, "gain": 3, "steps": 0,
              "steps_per_s": 2, "trainer_tokens_per_s": 0, "producer_tokens_per_s": 0}
    lines = ["| side | runs | " + " | ".join(METRICS) + " |",
             "|---|---:|" + "---:|" * len(METRICS)]
    for side, stats in summary.items():
        runs = stats[METRICS[0]]["runs"]
        lines.append(f"| {side} | {runs} | " +
                     " | ".join(_cell(stats[m], digits[m]) for m in METRICS) + " |")
    return "\n".join(lines)


def miles_throughput(metrics: list[dict], producer_beat: dict | None) -> dict:
    """Trainer tokens/s (response tokens over trainer step seconds, all steps) and producer
    tokens/s (the last producer heartbeat's tokens over its generation seconds)."""
    tokens = sum(m.get("trainer/tokens", 0.0) for m in metrics)
    step_s = sum(m.get("trainer/step_s", 0.0) for m in metrics)
    out = {"trainer_tokens_per_s": tokens / step_s if step_s else None,
           "producer_tokens_per_s": None}
    if producer_beat and producer_beat.get("generate_s"):
        out["producer_tokens_per_s"] = producer_beat["tokens"] / producer_beat["generate_s"]
    return out


def trl_throughput(steps: list[dict]) -> dict:
    """The same two rates from TRL's steps: generation is timed inside each step."""
    tokens = sum(s["tokens"] for s in steps)
    generate_s = sum(s["generate_s"] for s in steps)
    train_s = sum(s["step_s"] - s["generate_s"] for s in steps)
    return {"trainer_tokens_per_s": tokens / train_s if train_s > 0 else None,
            "producer_tokens_per_s": tokens / generate_s if generate_s > 0 else None}


def run_record(side: str, seed: int, *, initial: float, final: float, curve: list[dict],
               steps: int, rl_seconds: float, throughput: dict, detail: dict) -> dict:
    """One run's comparable numbers (the same keys on every side) and its side's detail."""
    return {"side": side, "seed": seed, "initial_accuracy": initial, "final_accuracy": final,
            "gain": final - initial, "curve": curve,
            "seconds_to_plus_25": seconds_to_target(curve, initial),
            "steps": steps, "rl_seconds": rl_seconds,
            "steps_per_s": steps / rl_seconds if rl_seconds else None,
            **throughput, "detail": detail}


# -- running the sides ---------------------------------------------------------------------------

def _affinity(cpus: list[int] | None):
    return None if not cpus else (lambda: os.sched_setaffinity(0, cpus))


def warm_start_dir(python: Path) -> Path:
    """The demo's warm start (built and cached on first use), found by the runs' python."""
    code = ("from miles.demo import DemoConfig; from miles.warm_start import warm_start; "
            "print(warm_start(DemoConfig()))")
    result = subprocess.run([str(python), "-c", code], check=True, capture_output=True,
                            text=True, cwd=REPO)
    return Path(result.stdout.strip().splitlines()[-1])


def run_miles(python: Path, side: str, seed: int, seconds: float, model_dir: Path, bus: str,
              run_dir: Path, cpus: list[int] | None, sets: list[str]) -> dict:
    args = [str(python), "-m", "miles.cli", "demo", "--out", str(run_dir), "--rl-seconds",
            str(seconds), "--model-dir", str(model_dir), "--bus", bus,
            "--set", f"seed={seed}", "--set", f"learner.seed={seed}",
            *MILES_MEASURED]
    for item in sets:
        args += ["--set", item]
    with open(run_dir.with_suffix(".log"), "w") as log:
        subprocess.run(args, check=True, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                       preexec_fn=_affinity(cpus))
        subprocess.run([str(python), str(REPO / "benchmarks" / "heldout_curve.py"),
                        "--model-dir", str(model_dir), "--run-dir", str(run_dir)], check=True,
                       cwd=REPO, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_affinity(cpus))
    shutil.rmtree(run_dir / "weights")  # every version, measured (GBs under full fine-tuning)
    report = json.loads((run_dir / "report.json").read_text())
    report["curve"] = json.loads((run_dir / "heldout_curve.json").read_text())["curve"]
    metrics_path = run_dir / "metrics.jsonl"
    metrics = [json.loads(line) for line in metrics_path.read_text().splitlines() if line]
    beat = asyncio.run(last_producer_beat(report["bus"] if side == "miles-kafka" else
                                          f"embedded://{run_dir.resolve() / 'bus'}",
                                          report["run"]))
    return run_record(side, seed, initial=report["initial_accuracy"],
                      final=report["final_accuracy"], curve=report["curve"],
                      steps=report["steps"], rl_seconds=report["rl_seconds"],
                      throughput=miles_throughput(metrics, beat),
                      detail={"report": report, "producer_heartbeat": beat})


async def last_producer_beat(bus_url: str, run: str) -> dict | None:
    """The newest producer heartbeat's counters on the run's status topic."""
    from miles.bus import open_bus
    from miles.errors import CodecError
    from miles.protocol import Heartbeat
    from miles.protocol.codec import decode
    from miles.protocol.topics import topic_name

    beat = None
    async with open_bus(bus_url) as bus:
        consumer = bus.consumer([topic_name(run, "status")],
                                group_id=f"vs-trl-{time.time_ns()}", from_beginning=True)
        async with consumer:
            while records := await consumer.poll(timeout_s=2.0):
                for record in records:
                    try:
                        value = decode(record.value, expected=Heartbeat)
                    except CodecError:
                        continue
                    if value.role == "producer":
                        beat = dict(value.extra)
    return beat


def run_trl(python: Path, seed: int, seconds: float, model_dir: Path, run_dir: Path,
            cpus: list[int] | None, sets: list[str]) -> dict:
    out = run_dir.with_suffix(".trl.json")
    args = [str(python), str(REPO / "benchmarks" / "trl_side.py"), "--model-dir",
            str(model_dir), "--seconds", str(seconds), "--seed", str(seed), "--out", str(out)]
    for item in sets:
        args += ["--set", item]
    with open(run_dir.with_suffix(".log"), "w") as log:
        subprocess.run(args, check=True, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                       preexec_fn=_affinity(cpus))
    result = json.loads(out.read_text())
    return run_record("trl", seed, initial=result["initial_accuracy"],
                      final=result["final_accuracy"], curve=result["curve"],
                      steps=result["steps"], rl_seconds=result["rl_seconds"],
                      throughput=trl_throughput(result["step_times"]), detail=result)


def start_broker(python: Path, data_dir: Path, port: int) -> str:
    subprocess.run([str(python), "-m", "miles.cli", "broker", "start", "--port", str(port),
                    "--data-dir", str(data_dir)], check=True, cwd=REPO)
    return f"kafka://127.0.0.1:{port}"


def stop_broker(python: Path, data_dir: Path) -> None:
    subprocess.run([str(python), "-m", "miles.cli", "broker", "stop", "--data-dir",
                    str(data_dir)], check=False, cwd=REPO)


# -- output ---------------------------------------------------------------------------------------

def plot(runs: list[dict], path: Path, seconds: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    labelled = set()
    for run in runs:
        points = [{"seconds": 0.0, "accuracy": run["initial_accuracy"]}, *run["curve"]]
        label = None if run["side"] in labelled else run["side"]
        labelled.add(run["side"])
        ax.plot([p["seconds"] for p in points], [p["accuracy"] for p in points], marker=".",
                color=COLOURS.get(run["side"], "black"), alpha=0.8, label=label)
    if runs:
        initial = statistics.median(run["initial_accuracy"] for run in runs)
        ax.axhline(initial + TARGET_GAIN, linestyle="--", color="grey",
                   label="warm start + 25 points")
    ax.set(xlabel="RL wall-clock (s)", ylabel="held-out greedy accuracy (1,000 problems)",
           title=f"Miles vs TRL GRPOTrainer, {seconds:.0f} s budget, one line per run",
           xlim=(0, max([seconds, *(p["seconds"] for r in runs for p in r["curve"])]) * 1.05))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_summary(runs: list[dict], out: Path, args: argparse.Namespace) -> str:
    summary = summarise(runs)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    order = ", ".join(f"{side}/{seed}" for seed, side in schedule(args.seeds, args.sides))
    text = "\n".join([
        f"# Miles vs TRL: {len(runs)} runs, {args.seconds:.0f} s of RL each",
        "", f"Order: {order}. Median (min-max) per side; `never`: +25 not reached.", "",
        summary_table(summary), "",
        "| run | warm start | final | +25 at (s) | steps | trainer tok/s | producer tok/s "
        "| load avg before |", "|---|---:|---:|---:|---:|---:|---:|---:|",
        *(f"| {r['side']}/{r['seed']} | {r['initial_accuracy']:.3f} | "
          f"{r['final_accuracy']:.3f} | {r['seconds_to_plus_25']} | {r['steps']} | "
          f"{_num(r['trainer_tokens_per_s'])} | {_num(r['producer_tokens_per_s'])} | "
          f"{r['load_before']:.2f} |" for r in runs), ""])
    (out / "summary.md").write_text(text)
    return text


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3, help="N seeds: FIRST..FIRST+N-1")
    parser.add_argument("--first-seed", type=int, default=0, help="FIRST (another round's "
                                                                   "seeds: --first-seed 3)")
    parser.add_argument("--seconds", type=float, default=120.0, help="RL wall-clock budget")
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--out", type=Path, default=Path("runs/vs-trl"))
    parser.add_argument("--bus", default=None, help="kafka://HOST:PORT for miles-kafka "
                                                     "(default: a broker started in OUT/broker)")
    parser.add_argument("--port", type=int, default=29392, help="the started broker's port")
    parser.add_argument("--python", type=Path, default=TRL_PYTHON,
                        help="the interpreter of every run (default: the TRL environment's)")
    parser.add_argument("--cpus", default=None, help="pin every run to these CPUs, e.g. 0,1")
    parser.add_argument("--set", dest="miles_sets", action="append", default=[],
                        metavar="KEY=VALUE", help="a Miles demo setting (both Miles sides)")
    parser.add_argument("--trl-set", dest="trl_sets", action="append", default=[],
                        metavar="KEY=VALUE", help="a GRPOConfig field of the TRL side")
    args = parser.parse_args(argv)
    args.seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    args.sides = [s for s in args.sides.split(",") if s]
    unknown = set(args.sides) - set(SIDES)
    if unknown:
        parser.error(f"unknown sides {sorted(unknown)}; choose from {', '.join(SIDES)}")
    if not args.python.is_file():
        parser.error(f"{args.python} is missing: build it with python3 scripts/trl_env.py")
    cpus = [int(c) for c in args.cpus.split(",")] if args.cpus else None
    out = args.out.resolve()
    (out / "runs").mkdir(parents=True, exist_ok=True)
    model_dir = warm_start_dir(args.python)
    bus, broker_dir = args.bus, None
    if "miles-kafka" in args.sides and bus is None:
        broker_dir = out / "broker"
        bus = start_broker(args.python, broker_dir, args.port)
    runs = []
    try:
        for seed, side in schedule(args.seeds, args.sides):
            run_dir = out / "runs" / f"{side}-seed{seed}"
            load = os.getloadavg()[0]
            print(f"[vs-trl] {side} seed {seed} (load {load:.2f})", flush=True)
            if side == "trl":
                record = run_trl(args.python, seed, args.seconds, model_dir, run_dir, cpus,
                                 args.trl_sets)
            else:
                record = run_miles(args.python, side, seed, args.seconds, model_dir,
                                   "embedded://" if side == "miles" else bus, run_dir, cpus,
                                   args.miles_sets)
            record["load_before"] = load
            run_dir.with_suffix(".json").write_text(json.dumps(record, indent=2))
            runs.append(record)
            print(f"[vs-trl] {side} seed {seed}: {record['initial_accuracy']:.3f} -> "
                  f"{record['final_accuracy']:.3f}, +25 at {record['seconds_to_plus_25']} s, "
                  f"{record['steps']} steps", flush=True)
    finally:
        if broker_dir is not None:
            stop_broker(args.python, broker_dir)
        if runs:
            plot(runs, out / "accuracy.png", args.seconds)
            print(write_summary(runs, out, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
