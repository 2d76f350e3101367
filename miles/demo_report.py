"""A run's report (`miles run`, `miles demo`): held-out accuracy before and after, steps,
staleness, what ended the run, time fractions, the producers' episode counters per episode, and
the curves (`report.json`, `curves.png`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from miles.evaluation import Curve
from miles.rollout_groups import EPISODE_COUNTERS

if TYPE_CHECKING:
    from miles.run import RunConfig


def producers_episodes(extras: dict[str, dict]) -> dict[str, int | float]:
    """The producers' episode counters (`episode_extras`) summed over their last heartbeats."""
    total: dict[str, int | float] = {}
    for extra in extras.values():
        for name in EPISODE_COUNTERS:
            total[name] = total.get(name, 0) + extra.get(name, 0)
    return total


def build_report(config: RunConfig, result: dict, curve: Curve, *, initial: float,
                 final: float, held_out: int, warm_s: float, wall_s: float,
                 model_dir: Path) -> dict:
    trainer = last_metrics(config.out_dir / "metrics.jsonl")
    rl_s = result["rl_seconds"]
    lags = {int(k): v for k, v in trainer.get("trainer/lag_histogram", {}).items()}
    target = initial + 0.25
    reached = next((p["seconds"] for p in curve.points if p["accuracy"] >= target), None)
    train_s = _metric_sum(config.out_dir / "metrics.jsonl", "trainer/step_s")
    generate_s = result["generate_s"]
    return {
        "bus": config.bus, "run": config.run, "model_dir": str(model_dir),
        "algo": config.learner.algorithm.name, "prompts": config.prompts,
        "env": config.env or "single_turn",
        "max_staleness": config.max_staleness,
        "initial_accuracy": initial, "final_accuracy": final,
        "held_out_problems": held_out,
        "steps": trainer.get("step", 0),
        "policy_version": int(trainer.get("trainer/policy_version", 0)),
        "wall_seconds": round(wall_s, 1), "rl_seconds": round(rl_s, 1),
        "rl_started_at": result["rl_started_at"],
        "ended_by": result["ended_by"],
        "warm_start_seconds": round(warm_s, 1), "engine": config.engine,
        "engine_start_seconds": round(result["engine_start_s"], 1),
        "seconds_to_plus_25": reached,
        "max_lag_seen": max(lags) if lags else 0, "lag_histogram": lags,
        "dropped_stale": trainer.get("trainer/dropped_stale", 0),
        "groups_trained": trainer.get("trainer/groups_trained", 0),
        "episodes": per_episode(result["episodes"]),
        "fraction_generating": round(generate_s / rl_s, 3),
        "fraction_training": round(train_s / rl_s, 3),
        "fraction_evaluating": round(curve.eval_seconds / rl_s, 3),
        "curve": curve.points,
    }


def per_episode(counts: dict) -> dict:
    """The producers' episode counters, with turns, tool calls and environment seconds per
    episode (empty for a single-turn run)."""
    if not counts:
        return {}
    episodes = max(counts.get("episodes", 0), 1)
    return {**counts, **{f"{name}_per_episode": round(counts.get(name, 0) / episodes, 4)
                         for name in ("turns", "tool_calls", "tool_errors", "env_s")}}


def last_metrics(path: Path) -> dict:
    lines = path.read_text().splitlines() if path.exists() else []
    return json.loads(lines[-1]) if lines else {}


def _metric_sum(path: Path, key: str) -> float:
    if not path.exists():
        return 0.0
    return sum(json.loads(line).get(key, 0.0) for line in path.read_text().splitlines() if line)


def plot_curves(report: dict, metrics_path: Path, out_path: Path) -> None:
    """Reward per step and held-out accuracy over RL time, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line] \
        if metrics_path.exists() else []
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot([r["step"] for r in rows], [r["trainer/reward_mean"] for r in rows])
    left.set(xlabel="step", ylabel="mean reward (training samples)", title="reward")
    points = [{"seconds": 0.0, "accuracy": report["initial_accuracy"]}, *report["curve"]]
    right.plot([p["seconds"] for p in points], [p["accuracy"] for p in points], marker="o")
    right.axhline(report["initial_accuracy"] + 0.25, linestyle="--", color="grey",
                  label="warm start + 25 points")
    right.set(xlabel="RL wall-clock (s)", ylabel="held-out greedy accuracy", title="accuracy")
    right.legend()
    fig.suptitle(f"miles demo: {report['bus']}, {report['algo']}, "
                 f"max_staleness={report['max_staleness']}")
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
