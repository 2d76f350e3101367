"""`miles run --resume` of a Kafka run whose trainer has nothing left to do: the resumed trainer
loads its last checkpoint, finds `max_steps` met and exits 0, possibly before any producer has
built its engine and said so on the bus. That ends the run by `max_steps`; it is no failure."""

from __future__ import annotations

import json
import time

import pytest

from tests.runs import start_run, write_config, write_dataset

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def test_resuming_a_finished_kafka_run_ends_it_by_max_steps(kafka_broker, model_dir, tmp_path):
    dataset = write_dataset(tmp_path / "data.jsonl", 64)
    out = tmp_path / "out"
    config = write_config(tmp_path / "run.toml", model_dir, out, dataset, max_steps=2,
                          checkpoint_every=2, bus=kafka_broker.url,
                          run=f"finished-{time.time_ns()}")
    log = tmp_path / "run.log"
    assert start_run(config, log).wait(300) == 0, log.read_text()[-3000:]
    assert start_run(config, log, "--resume").wait(300) == 0, log.read_text()[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert (report["ended_by"], report["steps"]) == ("max_steps", 2)
    assert "resumed at step 2" in (out / "trainer.log").read_text()
