"""`miles status` on both buses: heartbeats, consumer lag and the DLQ, read back exactly."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from miles.bus import Bus, TopicPartition, open_bus
from miles.bus.ranges import assign_all
from miles.cli import main
from miles.protocol import encode
from miles.protocol.topics import run_topics, topic_name
from miles.status import collect_status, format_status
from tests.conftest import unique_run
from tests.factories import make_dead_letter, make_heartbeat

def producer_beat(now: float, producer_id: str, ago: float, **extra):
    return make_heartbeat(producer_id=producer_id, created_at=now - ago, extra=extra)


def trainer_beat(now: float, ago: float, *, version: int, **extra):
    extra = {key.replace("_", "/", 1) if key.startswith(("trainer_", "lag_")) else key: value
             for key, value in extra.items()}
    return make_heartbeat(producer_id="trainer-x", role="trainer", engine="fsdp2",
                          policy_version=version, in_flight=0, tokens_per_s=0.0, extra=extra,
                          created_at=now - ago)


def heartbeats(now: float) -> list:
    return [
        # producer-0 restarted: its first beat's totals are from before the restart
        producer_beat(now, "producer-0", 30, groups=500, tokens=90_000, paused=False),
        producer_beat(now, "producer-0", 12, groups=10, tokens=1_000, paused=False),
        producer_beat(now, "producer-0", 2, groups=30, tokens=5_000, paused=False),
        producer_beat(now, "producer-1", 40, groups=7, tokens=700, paused=True,
                      error="version 3: sha256 mismatch"),
        trainer_beat(now, 11, version=5, step=5, consumed=3, trainer_groups_trained=40,
                     trainer_dropped_stale=1, trainer_dead_lettered=0, lag_0=30, lag_1=10),
        trainer_beat(now, 1, version=9, step=9, consumed=4, trainer_groups_trained=72,
                     trainer_dropped_stale=3, trainer_dead_lettered=2, lag_0=50, lag_1=20,
                     lag_2=2),
    ]


async def commit_group(bus: Bus, topic: str, group_id: str, offsets: dict[int, int]) -> None:
    async with bus.consumer([topic], group_id=group_id) as consumer:
        await assign_all(bus, consumer, topic)
        await consumer.commit({TopicPartition(topic, p): o for p, o in offsets.items()})


async def publish_run(bus: Bus, run: str, now: float) -> None:
    status = topic_name(run, "status")
    for beat in heartbeats(now):
        await bus.publish(status, encode(beat), key=beat.producer_id.encode())
    await bus.publish(status, b"not a heartbeat")
    trajectories, prompts = topic_name(run, "trajectories"), topic_name(run, "prompts")
    for partition, count in ((0, 4), (1, 2), (2, 1)):
        for _ in range(count):
            await bus.publish(trajectories, b"group", partition=partition)
    for _ in range(5):
        await bus.publish(prompts, b"prompt", partition=0)
    for offset in (7, 8):
        await bus.publish(topic_name(run, "dlq"), encode(make_dead_letter(source_offset=offset)))
    await commit_group(bus, trajectories, f"miles.{run}.recorder", {0: 1, 1: 2})
    await commit_group(bus, prompts, f"miles.{run}.producers", {0: 5, 1: 0, 2: 0})


async def test_collect_status_reads_back_the_run(bus, run):
    now = float(int(time.time()))  # whole seconds, so every gap is exact
    await publish_run(bus, run, now)
    status = await collect_status(bus, run, now=now)
    assert status["producers"] == [
        {"id": "producer-0", "engine": "hf", "policy_version": 3, "in_flight": 2,
         "tokens_per_s": 400.0, "groups_per_s": 2.0, "groups": 30, "paused": False,
         "weight_errors": None, "last_error": None, "waiting": None, "stream": {},
         "refused": {}, "age_s": 2.0, "live": True},
        {"id": "producer-1", "engine": "hf", "policy_version": 3, "in_flight": 2,
         "tokens_per_s": 1234.5, "groups_per_s": None, "groups": 7, "paused": True,
         "weight_errors": None, "last_error": "version 3: sha256 mismatch", "waiting": None,
         "stream": {}, "refused": {}, "age_s": 40.0, "live": False},
    ]
    assert status["trainer"] == {
        "id": "trainer-x", "policy_version": 9, "step": 9, "steps_per_s": 0.4,
        "groups_per_s": 3.2, "consumed": 4, "backlog": 3, "groups_trained": 72,
        "dropped_stale": 3, "filtered_groups": None, "regenerated_groups": None,
        "dead_lettered": 2,
        "lag_histogram": {0: 20, 1: 10, 2: 2}, "lag_histogram_total": {0: 50, 1: 20, 2: 2},
        "age_s": 1.0, "live": True}
    assert status["consumer_lag"] == {
        f"miles.{run}.producers": {"prompts": {"lag": 0, "committed_partitions": 3,
                                               "partitions": 3}},
        f"miles.{run}.recorder": {"trajectories": {"lag": 3, "committed_partitions": 2,
                                                   "partitions": 3}}}
    assert status["records"] == {"prompts": 5, "trajectories": 7, "control": 0, "status": 7,
                                 "dlq": 2}
    assert (status["dlq_records"], status["invalid_heartbeats"]) == (2, 1)

    text = format_status(status)
    assert "producers: 1 live, 1 stale" in text
    assert "  producer-0  hf      v3       2          400.0     2.00      30      live" in text
    assert "stale paused  40.0s ago" in text
    assert "producer-1: last error: version 3: sha256 mismatch" in text
    assert ("trainer trainer-x: v9 step 9, live (seen 1.0s ago)\n"
            "  0.40 steps/s, 3.20 groups/s, backlog 3 records, dropped stale 3, "
            "dead-lettered 2\n") in text
    assert "lag of groups trained in the window (lag:groups): 0:20 1:10 2:2" in text
    assert f"miles.{run}.recorder: trajectories 3 (2/3 partitions)" in text
    assert f"miles.{run}.producers: prompts 0\n" in text
    assert "dlq: 2 records" in text


async def test_a_window_after_the_heartbeats_sees_no_one(bus, run):
    await bus.publish(topic_name(run, "status"), encode(heartbeats(time.time())[0]))
    status = await collect_status(bus, run, window_s=60, now=time.time() + 3600)
    assert (status["producers"], status["trainer"], status["consumer_lag"]) == ([], None, {})
    assert "trainer: no heartbeat in the window" in format_status(status)


@pytest.mark.kafka
def test_cli_status_prints_json(kafka_broker, capsys):
    run = unique_run()

    async def prepare():
        async with open_bus(kafka_broker.url) as bus:
            await bus.create_topics(run_topics(run, prompt_partitions=3,
                                               trajectory_partitions=3))
            await publish_run(bus, run, time.time())

    asyncio.run(prepare())
    assert main(["status", "--bootstrap", kafka_broker.bootstrap, "--run", run, "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert [(p["id"], p["live"]) for p in status["producers"]] == [
        ("producer-0", True), ("producer-1", False)]
    assert status["trainer"]["lag_histogram"] == {"0": 20, "1": 10, "2": 2}
    assert status["dlq_records"] == 2
    assert main(["status", "--bus", kafka_broker.url, "--run", run]) == 0
    assert "producers: 1 live, 1 stale" in capsys.readouterr().out
