"""The `miles` command against the real broker: broker lifecycle, topics, smoke run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from miles import broker
from miles.bus import open_bus
from miles.cli import main
from miles.errors import BusError
from miles.protocol.topics import TopicSpec, run_topics
from tests.conftest import unique_run

pytestmark = pytest.mark.kafka


def miles(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "miles.cli", *args], capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow
def test_broker_start_status_stop_and_data_survives_restart(tmp_path):
    port = str(broker.free_port())
    data = str(tmp_path / "broker")
    started = miles("broker", "start", "--port", port, "--data-dir", data, "--heap", "384m")
    assert started.returncode == 0, started.stderr
    assert started.stdout.strip() == f"127.0.0.1:{port}"
    try:
        status = miles("broker", "status", "--data-dir", data)
        assert status.returncode == 0 and json.loads(status.stdout)["port"] == int(port)
        run = unique_run()
        assert miles("topics", "create", "--bootstrap", f"127.0.0.1:{port}",
                     "--run", run).returncode == 0
        assert miles("broker", "stop", "--data-dir", data).stdout.strip() == "stopped"
        assert miles("broker", "status", "--data-dir", data).returncode == 1
        assert miles("broker", "start", "--port", port, "--data-dir", data,
                     "--heap", "384m").returncode == 0
        described = miles("topics", "describe", "--bootstrap", f"127.0.0.1:{port}", "--run", run)
        assert described.returncode == 0, described.stderr
        assert f"miles.{run}.trajectories: partitions=8 retention.ms=-1" in described.stdout
    finally:
        miles("broker", "stop", "--data-dir", data)
    assert broker.running_info(tmp_path / "broker") is None


def test_topics_create_twice_then_describe(kafka_broker, capsys):
    run = unique_run()
    assert main(["topics", "create", "--bootstrap", kafka_broker.bootstrap, "--run", run,
                 "--trajectory-partitions", "2"]) == 0
    assert capsys.readouterr().out.count(": created") == 5
    assert main(["topics", "create", "--bootstrap", kafka_broker.bootstrap, "--run", run]) == 0
    assert capsys.readouterr().out.count(": exists") == 5
    assert main(["topics", "describe", "--bootstrap", kafka_broker.bootstrap, "--run", run]) == 0
    out = capsys.readouterr().out
    assert f"miles.{run}.trajectories: partitions=2" in out
    assert f"miles.{run}.control: partitions=1" in out


def test_describe_missing_topics_is_an_error(kafka_broker, capsys):
    assert main(["topics", "describe", "--bootstrap", kafka_broker.bootstrap,
                 "--run", unique_run()]) == 2
    assert "do not exist" in capsys.readouterr().err


async def test_per_topic_creation_errors_are_reported(kafka_broker):
    bad = TopicSpec(name=f"miles.{unique_run()}.prompts", partitions=1,
                    configs={"retention.ms": "not-a-number"})
    async with open_bus(kafka_broker.url) as bus:
        with pytest.raises(BusError, match=bad.name):
            await bus.create_topics([bad, *run_topics(unique_run())])


def test_smoke_on_kafka(kafka_broker, capsys):
    assert main(["smoke", "--bus", kafka_broker.url, "--groups", "50"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["groups_consumed"] == 50 and report["dead_lettered"] == 1

