"""`miles demo` end to end, short: the report, the curve and the staleness bound (embedded
bus, the session's tiny model as the starting checkpoint instead of the cached warm start)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from miles.config import load_config
from miles.demo import DemoConfig, main_demo


def test_a_short_embedded_demo_writes_its_report_and_curves(model_dir, tmp_path):
    config = load_config(DemoConfig, env={}, overrides=[
        f"model_dir={model_dir}", f"out_dir={tmp_path}", "max_seconds=6", "eval_every_s=1",
        "eval_problems=16", "groups_per_step=4", "lora.r=4", "lora.alpha=8",
        "trackers.report_to=tensorboard", "trackers.samples_every=1", "trackers.samples_rows=2"])
    assert main_demo(config) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["run"] == tmp_path.name and report["model_dir"] == str(model_dir)
    assert report["ended_by"] == "max_seconds"
    assert report["steps"] >= 2 and report["policy_version"] == report["steps"]
    assert report["max_lag_seen"] <= report["max_staleness"] == 1
    assert report["held_out_problems"] == 1000 and 0 <= report["final_accuracy"] <= 1
    assert report["curve"] and all(p["policy_version"] >= 1 for p in report["curve"])
    assert (tmp_path / "curves.png").stat().st_size > 0
    assert len(list((tmp_path / "weights").iterdir())) <= 16  # the store is pruned
    assert_tracked(tmp_path, steps=report["steps"], measured=len(report["curve"]))


@pytest.mark.parametrize("after_run", [True, False], ids=["after-run", "during-run"])
def test_the_curve_is_measured_after_the_run_or_during_it(model_dir, tmp_path, after_run):
    """`eval_after_run` (the demo's default): the versions taken every `eval_every_s` are
    measured after training, at the seconds they were taken, and no evaluation ran during RL;
    without it the evaluator measures during the run and takes a share of its time."""
    config = load_config(DemoConfig, env={}, overrides=[
        f"model_dir={model_dir}", f"out_dir={tmp_path}", "max_seconds=5", "eval_every_s=1",
        "eval_problems=16", "groups_per_step=4", "lora.r=4", "lora.alpha=8",
        f"eval_after_run={str(after_run).lower()}"])
    assert main_demo(config) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    curve = report["curve"]
    seconds, versions = [p["seconds"] for p in curve], [p["policy_version"] for p in curve]
    assert len(curve) >= 2 and seconds == sorted(seconds) and versions == sorted(versions)
    assert seconds[-1] <= report["rl_seconds"] + 1.0 and versions[-1] <= report["steps"]
    if after_run:
        assert report["fraction_evaluating"] == 0
    else:
        assert report["fraction_evaluating"] > 0


def assert_tracked(out_dir, *, steps: int, measured: int) -> None:
    """The embedded trainer, producer and evaluator each logged to their TensorBoard run, and
    the trainer wrote a sample table every step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = out_dir / "trackers" / "tensorboard" / out_dir.name  # the run is named after out_dir
    assert sorted(p.name for p in runs.iterdir()) == ["evaluator", "producer-0", "trainer"]
    series = {}
    for role, key in [("trainer", "trainer/loss"), ("producer-0", "producer/groups"),
                      ("evaluator", "held_out/accuracy")]:
        events = EventAccumulator(str(runs / role), size_guidance={"scalars": 0})
        events.Reload()
        series[role] = events.Scalars(key)
    assert len(series["trainer"]) == steps and len(series["evaluator"]) == measured
    assert series["producer-0"][-1].value > 0
    rows = [json.loads(line) for line in (out_dir / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [s for s in range(1, steps + 1) for _ in range(2)]


@pytest.mark.parametrize("bus", ["embedded", pytest.param("kafka", marks=pytest.mark.kafka)])
def test_a_short_demo_with_an_environment_trains_episodes(bus, model_dir, tmp_path, request):
    """`--set env=module:Name` (the producer's environment) on both buses: the producer plays
    episodes (two turns each), the trainer trains them (samples with a loss mask) and held-out
    evaluation plays the same episodes greedily."""
    overrides = [f"model_dir={model_dir}", f"out_dir={tmp_path}", "max_seconds=8",
                 "eval_every_s=1", "eval_problems=8", "groups_per_step=4", "lora.r=4",
                 "lora.alpha=8", "env=tests.envs:SecondTry"]
    if bus == "kafka":
        overrides.append(f"bus={request.getfixturevalue('kafka_broker').url}")
    assert main_demo(load_config(DemoConfig, env={}, overrides=overrides)) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["env"] == "tests.envs:SecondTry" and report["steps"] >= 2
    assert report["curve"] and 0 <= report["final_accuracy"] <= 1
    episodes = report["episodes"]
    assert episodes["episodes"] > 0 and episodes["turns_per_episode"] == 2
    assert episodes["failed_episodes"] == 0
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines and all(line["trainer/episode_samples"] > 0 for line in lines)
    if bus == "kafka":
        settings = (tmp_path / "producer-0.yaml").read_text()
        assert "env: tests.envs:SecondTry" in settings and "max_total_tokens" in settings


def test_a_signal_during_the_warm_start_stops_the_demo_at_once(tmp_path):
    """The supervised warm start runs off the event loop and asks before each step whether
    to stop, so Ctrl-C is heard within a step instead of after the whole SFT."""
    command = [sys.executable, "-c", "import sys; from miles.cli import main; sys.exit(main())",
               "demo", "--out", str(tmp_path / "out"), "--set", "sft.steps=100000"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env={**os.environ, "HOME": str(tmp_path)})
    try:
        lines = []
        for line in process.stdout:
            lines.append(line)
            if "sft step 1/100000" in line:
                break
        began = time.monotonic()
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=60)
    finally:
        process.kill()
    assert time.monotonic() - began < 30
    assert process.returncode == 2, "".join(lines) + output
    assert "the supervised warm start was stopped at step" in output
    assert not list((tmp_path / ".cache" / "miles" / "demo").glob("sft-*/config.json"))
