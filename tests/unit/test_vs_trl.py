"""benchmarks/vs_trl.py's pure logic (order of runs, time to target, median and range, the
throughput rates, the table), heldout_curve.py's grid and choice of versions, and trl_side.py's
settings against the demo's, without TRL."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from miles.demo import DemoConfig

REPO = Path(__file__).resolve().parents[2]


def load(name: str):
    import sys

    if str(REPO / "benchmarks") not in sys.path:  # trl_side imports heldout_curve, as a script
        sys.path.insert(0, str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


vs_trl = load("vs_trl")


def test_runs_are_interleaved_seed_by_seed():
    order = vs_trl.schedule([0, 1], ["miles", "miles-kafka", "trl"])
    assert order == [(0, "miles"), (0, "miles-kafka"), (0, "trl"),
                     (1, "miles"), (1, "miles-kafka"), (1, "trl")]


def test_seconds_to_target_is_the_first_point_at_or_above_it():
    curve = [{"seconds": 10.0, "accuracy": 0.30}, {"seconds": 20.0, "accuracy": 0.50},
             {"seconds": 30.0, "accuracy": 0.40}, {"seconds": 40.0, "accuracy": 0.70}]
    assert vs_trl.seconds_to_target(curve, 0.25) == 20.0  # 0.50 is exactly +25 points
    assert vs_trl.seconds_to_target(curve, 0.30) == 40.0
    assert vs_trl.seconds_to_target(curve, 0.50) is None
    assert vs_trl.seconds_to_target([], 0.25) is None


def test_median_range_counts_never_as_slowest():
    assert vs_trl.median_range([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0,
                                                    "reached": 3, "runs": 3}
    one_never = vs_trl.median_range([10.0, None, 30.0])
    assert one_never == {"median": 30.0, "min": 10.0, "max": None, "reached": 2, "runs": 3}
    assert vs_trl.median_range([None, None, 5.0])["median"] is None
    assert vs_trl.median_range([1.0, 4.0])["median"] == 2.5
    assert vs_trl.median_range([])["runs"] == 0


def record(side: str, seed: int, final: float, reached: float | None) -> dict:
    curve = [] if reached is None else [{"seconds": reached, "accuracy": 0.6}]
    return vs_trl.run_record(side, seed, initial=0.25, final=final, curve=curve, steps=100,
                             rl_seconds=50.0, detail={},
                             throughput={"trainer_tokens_per_s": 1000.0,
                                         "producer_tokens_per_s": None})


def test_summary_per_side_and_its_table():
    runs = [record("miles", 0, 0.7, 12.0), record("trl", 0, 0.5, None),
            record("miles", 1, 0.8, 20.0), record("trl", 1, 0.6, 40.0),
            record("miles", 2, 0.75, 16.0), record("trl", 2, 0.55, None)]
    summary = vs_trl.summarise(runs)
    assert list(summary) == ["miles", "trl"]
    assert summary["miles"]["seconds_to_plus_25"]["median"] == 16.0
    assert summary["miles"]["final_accuracy"] == {"median": 0.75, "min": 0.7, "max": 0.8,
                                                  "reached": 3, "runs": 3}
    assert summary["miles"]["gain"]["median"] == pytest.approx(0.5)
    assert summary["miles"]["steps_per_s"]["median"] == 2.0
    assert summary["trl"]["seconds_to_plus_25"]["median"] is None  # 2 of 3 never reached
    table = vs_trl.summary_table(summary)
    assert "| miles | 3 | 16.0 (12.0-20.0) | 0.750 (0.700-0.800) |" in table
    assert "| trl | 3 | never (40.0-never), 1/3 reached |" in table
    assert table.splitlines()[1].count("---:") == len(vs_trl.METRICS) + 1


def test_throughput_rates_on_both_sides():
    metrics = [{"trainer/tokens": 900.0, "trainer/step_s": 0.5},
               {"trainer/tokens": 700.0, "trainer/step_s": 0.3}]
    miles = vs_trl.miles_throughput(metrics, {"tokens": 5000, "generate_s": 2.5})
    assert miles == {"trainer_tokens_per_s": pytest.approx(2000.0),
                     "producer_tokens_per_s": pytest.approx(2000.0)}
    assert vs_trl.miles_throughput([], None) == {"trainer_tokens_per_s": None,
                                                 "producer_tokens_per_s": None}
    steps = [{"step_s": 1.0, "generate_s": 0.25, "tokens": 600},
             {"step_s": 2.0, "generate_s": 0.75, "tokens": 900}]
    assert vs_trl.trl_throughput(steps) == {"trainer_tokens_per_s": pytest.approx(750.0),
                                            "producer_tokens_per_s": pytest.approx(1500.0)}


def test_trl_settings_follow_the_demo():
    trl_side = load("trl_side")  # imports torch and Miles, not TRL
    demo = DemoConfig()
    settings = trl_side.TRL_SETTINGS
    assert settings["learning_rate"] == demo.learner.lr
    assert settings["max_completion_length"] == demo.sampling.max_new_tokens
    assert settings["num_generations"] == demo.sampling.n
    assert settings["per_device_train_batch_size"] == demo.groups_per_step * demo.sampling.n
    assert settings["temperature"] == demo.sampling.temperature
    assert settings["num_train_epochs"] == demo.epochs
    assert settings["max_grad_norm"] == demo.learner.grad_clip
    assert settings["use_cpu"] is True and "bf16" not in settings  # bf16: auto_bf16()
    assert trl_side.DEMO.lora == demo.lora and demo.lora is not None
    assert trl_side.DEMO.eval_problems == demo.eval_problems
    assert demo.learner.algorithm.name == "grpo" and demo.learner.algorithm.loss.kl_coef == 0
    assert [trl_side.parse_value(v) for v in ("1e-4", "true", "constant", "null")] == \
        [1e-4, True, "constant", None]


def test_the_curve_grid_is_dense_first():
    heldout = load("heldout_curve")
    assert heldout.grid(4.5) == [1.0, 2.0, 3.0, 4.0]
    points = heldout.grid(50)
    assert points[:30] == [float(t) for t in range(1, 31)]
    assert points[30:] == [35.0, 40.0, 45.0, 50.0]


def test_each_point_gets_the_newest_version_made_by_then():
    heldout = load("heldout_curve")
    snapshots = [(1.5, 2), (0.4, 1), (2.0, 3), (2.7, 4), (6.0, 9)]  # (seconds, version)
    assert heldout.newest_at(snapshots, [0.2, 1.0, 2.0, 3.0, 4.0, 7.0]) == \
        [(1.0, 1), (2.0, 3), (3.0, 4), (4.0, 4), (7.0, 9)]  # none by 0.2 s: left out
    assert heldout.newest_at([], [1.0]) == []


def test_a_miles_runs_versions_are_timed_from_its_clock(tmp_path):
    import json

    heldout = load("heldout_curve")
    (tmp_path / "report.json").write_text(json.dumps({"rl_started_at": 1000.0}))
    rows = [{"step": 1, "time": 1000.8, "trainer/policy_version": 1.0},
            {"step": 2, "time": 1001.5, "trainer/policy_version": 2.0}, {"step": 3}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert heldout.miles_snapshots(tmp_path) == [(pytest.approx(0.8), 1),
                                                 (pytest.approx(1.5), 2)]
