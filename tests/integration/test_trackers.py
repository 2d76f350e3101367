"""Experiment trackers and sample tables, read back with each library's own reader.

A real trainer (tiny model, embedded bus) logs to TensorBoard, W&B (offline) and MLflow (its
SQLite store) at once; every number of metrics.jsonl comes back from each tracker at its step
(TensorBoard keeps float32), and the sample tables come back every `samples_every` steps, the
same rows as samples.jsonl. The producer's heartbeat counters and the evaluator's held-out
accuracy reach a tracker under their names. Naming an unknown tracker, or one whose library is
missing, fails when the settings are read.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from miles.bus import open_bus
from miles.config import load_config
from miles.errors import ConfigError
from miles.protocol import encode
from miles.protocol.topics import run_topics, topic_name
from miles.trackers import TrackerSettings, Trackers, open_trackers
from miles.trainer import distributed
from miles.trainer.learner import Learner, LearnerConfig
from miles.trainer.loop import LoopConfig, TrainerLoop
from miles.trainer.model import LoraSettings
from miles.trainer.runner import StepRunner
from tests.conftest import unique_run
from tests.poison import good_groups

PER_STEP = 2
SAMPLE_COLUMNS = ["step", "group_id", "prompt", "completion", "reward", "advantage",
                  "min_version", "max_version", "lag", "finish_reason"]


@pytest.fixture(scope="module", autouse=True)
def process_group():
    yield
    distributed.destroy()


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """W&B offline with its caches in the test's folder; MLflow on its default local store."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


async def train(model_dir, out: Path, settings: TrackerSettings, steps: int) -> Trackers:
    """`steps` trainer steps of `PER_STEP` groups with `settings`' trackers (closed on return)."""
    run = unique_run()
    async with open_bus("embedded://") as bus:
        await bus.create_topics(run_topics(run, trajectory_partitions=1))
        for group in good_groups(PER_STEP * steps):
            await bus.publish(topic_name(run, "trajectories"), encode(group))
        learner = Learner(model_dir, LearnerConfig(lr=1e-2), lora=LoraSettings(r=4, alpha=8))
        config = LoopConfig(run=run, out_dir=out, groups_per_step=PER_STEP, max_steps=steps,
                            max_staleness=1000, checkpoint_every=0)
        with open_trackers(settings, role="trainer", run=run, default_dir=out / "trackers",
                           config=config) as trackers:
            loop = TrainerLoop(bus, StepRunner(learner, config, base_model=str(model_dir)),
                               trackers)
            await asyncio.wait_for(loop.run(asyncio.Event()), 120)
    return run


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def numbers(line: dict) -> dict[str, float]:
    return {k: v for k, v in line.items() if k not in ("step", "time")
            and isinstance(v, (int, float)) and not isinstance(v, bool)}


# -- readers: each library's own ---------------------------------------------------------------

def tensorboard_events(folder: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def wandb_records(tracker_dir: Path) -> list[dict]:
    """The offline run's records, as W&B's own reader prints them (`wandb leet inspect`)."""
    runs = list((tracker_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json",
                          str(runs[0])], capture_output=True, text=True, check=True, timeout=60)
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def mlflow_run(tracker_dir: Path, role: str):
    from mlflow.tracking import MlflowClient

    from miles.trackers import mlflow_uri

    client = MlflowClient(tracking_uri=mlflow_uri(tracker_dir))
    experiment = client.get_experiment_by_name("miles")
    (run,) = client.search_runs([experiment.experiment_id],
                                filter_string=f"tags.`miles.role` = '{role}'")
    return client, run


# -- the trainer -------------------------------------------------------------------------------

async def test_every_tracker_gets_the_trainers_metrics_and_sample_tables(model_dir, tmp_path,
                                                                        offline):
    steps, every = 4, 2
    settings = TrackerSettings(report_to=("tensorboard", "wandb", "mlflow"),
                               samples_every=every, samples_rows=3)
    run = await train(model_dir, tmp_path, settings, steps)
    lines = jsonl(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in lines] == list(range(1, steps + 1))
    expected = {m["step"]: numbers(m) for m in lines}
    assert "trainer/loss" in expected[1] and "trainer/step_s" in expected[1]
    rows = jsonl(tmp_path / "samples.jsonl")
    assert [r["step"] for r in rows] == [2, 2, 2, 4, 4, 4], "samples_every=2, 3 rows each"
    assert all(list(r) == SAMPLE_COLUMNS for r in rows)
    assert all(r["prompt"] and r["completion"] and r["lag"] == r["step"] - 1 - r["min_version"]
               for r in rows)
    tracker_dir = tmp_path / "trackers"

    events = tensorboard_events(tracker_dir / "tensorboard" / run / "trainer")
    for key in expected[1]:
        got = {e.step: e.value for e in events.Scalars(key)}
        want = {step: values[key] for step, values in expected.items()}
        assert got == pytest.approx(want, rel=1e-6, abs=1e-30), key
    tables = events.Tensors("samples/text_summary")
    assert [t.step for t in tables] == [2, 4]
    from tensorboard.util.tensor_util import make_ndarray
    text = make_ndarray(tables[0].tensor_proto).item().decode()
    assert text.splitlines()[0] == "| " + " | ".join(SAMPLE_COLUMNS) + " |"
    assert len(text.splitlines()) == 2 + 3 and rows[0]["group_id"] in text

    records = wandb_records(tracker_dir)
    history = {r["history"]["step"]["num"]: r["history"]["item"] for r in records
               if r["type"] == "history"}
    assert sorted(history) == list(range(1, steps + 1))
    for step, values in expected.items():
        assert {k: history[step][k] for k in values} == values, step
    table_steps = [s for s, item in history.items() if "samples.path" in item]
    assert table_steps == [2, 4]
    run_dir = next((tracker_dir / "wandb").glob("offline-run-*"))
    table = json.loads((run_dir / "files" / history[4]["samples.path"]).read_text())
    assert table["columns"] == SAMPLE_COLUMNS
    assert table["data"] == [list(r.values()) for r in rows[3:]]

    client, tracked = mlflow_run(tracker_dir, "trainer")
    assert tracked.info.run_name == f"{run}-trainer" and tracked.info.status == "FINISHED"
    for key in expected[1]:
        got = {m.step: m.value for m in client.get_metric_history(tracked.info.run_id, key)}
        assert got == {step: values[key] for step, values in expected.items()}, key
    logged = [f.path for f in client.list_artifacts(tracked.info.run_id, "samples")]
    assert logged == ["samples/step_000002.json", "samples/step_000004.json"]
    local = client.download_artifacts(tracked.info.run_id, "samples/step_000002.json",
                                      str(tmp_path / "download"))
    table = json.loads(Path(local).read_text())
    assert table["columns"] == SAMPLE_COLUMNS
    assert [row[1] for row in table["data"]] == [r["group_id"] for r in rows[:3]]


async def test_samples_every_sets_which_steps_get_a_table_without_trackers(model_dir, tmp_path):
    await train(model_dir, tmp_path, TrackerSettings(samples_every=3, samples_rows=1), steps=3)
    assert [(r["step"], r["group_id"]) for r in jsonl(tmp_path / "samples.jsonl")] == \
        [(3, "group-004")]
    assert not (tmp_path / "trackers").exists(), "no tracker named, none written"


async def test_no_sample_table_by_default(model_dir, tmp_path):
    await train(model_dir, tmp_path, TrackerSettings(), steps=1)
    assert not (tmp_path / "samples.jsonl").exists()


# -- the producer and the evaluator ------------------------------------------------------------

async def test_the_producers_heartbeat_counters_reach_the_tracker(model_dir, tmp_path):
    from miles.engines.hf import HFEngine
    from miles.rollout import RolloutConfig, RolloutWorker
    from miles.tasks.rewards import Scorer, exact_match

    run = unique_run()
    settings = TrackerSettings(report_to=("tensorboard",))
    engine = HFEngine(model_dir)
    async with open_bus("embedded://") as bus:
        await bus.create_topics(run_topics(run))
        with open_trackers(settings, role="producer-7", run=run,
                           default_dir=tmp_path) as trackers:
            worker = RolloutWorker(bus, engine, Scorer(exact_match),
                                   RolloutConfig(run=run, producer_id="producer-7"),
                                   trackers=trackers)
            worker.counts["producer/groups"] = 5
            await worker._heartbeat()
            worker.counts["producer/groups"] = 9
            await worker._heartbeat()
    engine.close()
    events = tensorboard_events(tmp_path / "tensorboard" / run / "producer-7")
    assert [(e.step, e.value) for e in events.Scalars("producer/groups")] == [(1, 5), (2, 9)]
    assert {"producer/generate_s", "producer/tokens_per_s", "producer/policy_version"} <= \
        set(events.Tags()["scalars"])


async def test_the_evaluators_held_out_accuracy_reaches_the_tracker(model_dir, tmp_path,
                                                                   monkeypatch):
    """Measurements stubbed (the loading and measuring are tested elsewhere): what `follow`
    does with each point."""
    from miles.evaluation import Evaluator

    run = unique_run()
    settings = TrackerSettings(report_to=("tensorboard",))
    async with open_bus("embedded://") as bus:
        await bus.create_topics(run_topics(run))
        with open_trackers(settings, role="evaluator", run=run, default_dir=tmp_path) as tracked:
            evaluator = Evaluator(bus, run, model_dir, None, [], every_s=0.01, trackers=tracked)
            accuracies = iter([0.25, 0.5])

            async def load_newest():
                evaluator.engine._policy_version += 2  # what loading a version does
                return True

            async def measure():
                return next(accuracies)

            monkeypatch.setattr(evaluator, "load_newest", load_newest)
            monkeypatch.setattr(evaluator, "measure", measure)
            monkeypatch.setattr(evaluator, "read_topics", lambda: asyncio.sleep(0))
            stop = asyncio.Event()
            async with evaluator:
                following = asyncio.create_task(evaluator.follow(stop, 0.0))
                for _ in range(1000):
                    if len(evaluator.curve.points) >= 2 or following.done():
                        break
                    await asyncio.sleep(0.01)
                stop.set()
                await following
    events = tensorboard_events(tmp_path / "tensorboard" / run / "evaluator")
    assert [(e.step, e.value) for e in events.Scalars("held_out/accuracy")][:2] == \
        [(2, 0.25), (4, 0.5)]


# -- settings ----------------------------------------------------------------------------------

@pytest.mark.parametrize("daemon", ["consumers.trainer:TrainerSettings",
                                    "producers.rollout:ProducerSettings",
                                    "consumers.evaluator:EvaluatorSettings"])
def test_an_unknown_tracker_is_refused_when_the_settings_are_read(daemon):
    import importlib

    module, name = daemon.split(":")
    settings = getattr(importlib.import_module(module), name)
    with pytest.raises(ConfigError, match=r"trackers\.report_to: unknown tracker 'comet'"):
        load_config(settings, overrides=["trackers.report_to=tensorboard,comet"], env={})


@pytest.mark.parametrize("name", ["tensorboard", "wandb", "mlflow"])
def test_a_tracker_whose_library_is_missing_names_the_extra(monkeypatch, name):
    from consumers.trainer import TrainerSettings

    monkeypatch.setitem(sys.modules, name, None)  # find_spec then says: not installed
    with pytest.raises(ConfigError, match=rf"{name} is not installed: pip install "
                                          rf"'miles\[{name}\]'"):
        load_config(TrainerSettings, overrides=[f"trackers.report_to={name}"], env={})


def test_the_demo_hands_its_trackers_to_every_daemon(tmp_path):
    from miles.demo import DemoConfig
    from miles.run_daemons import daemon_settings

    config = load_config(DemoConfig, overrides=[f"out_dir={tmp_path}",
                                                "trackers.report_to=tensorboard",
                                                "trackers.samples_every=5"], env={})
    for name in ("producer-0", "trainer", "evaluator"):
        trackers = daemon_settings(config, tmp_path / "model")[name].trackers
        assert trackers.report_to == ("tensorboard",) and trackers.samples_every == 5
        assert trackers.dir == tmp_path / "trackers"
