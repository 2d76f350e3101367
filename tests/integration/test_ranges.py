"""Bounded, ordered range reads of a topic, on the embedded bus and on the real broker."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from miles.bus import open_bus
from miles.bus.ranges import Bound, RangeError, parse_bound, read_range
from miles.errors import ConfigError
from miles.protocol.topics import run_topics, topic_name
from tests.conftest import unique_run

COUNT = 12  # records, round-robin over the 3 trajectory partitions


async def publish_spread(bus, topic: str) -> None:
    for i in range(COUNT):
        await bus.publish(topic, str(i).encode(), partition=i % 3)
        await asyncio.sleep(0.003)  # distinct millisecond timestamps


async def read(bus, topic: str, start: str = "earliest", end: str = "latest") -> list:
    return [r async for r in read_range(bus, topic, parse_bound(start), parse_bound(end),
                                        group_id=f"range-{uuid.uuid4().hex[:8]}")]


def values(records) -> list[int]:
    return [int(r.value) for r in records]


async def test_whole_range_comes_back_in_timestamp_order_every_time(bus, run):
    topic = topic_name(run, "trajectories")
    await publish_spread(bus, topic)
    first = await read(bus, topic)
    assert values(first) == list(range(COUNT))
    again = await read(bus, topic)
    assert [(r.partition, r.offset) for r in again] == [(r.partition, r.offset) for r in first]


async def test_offset_and_time_bounds(bus, run):
    topic = topic_name(run, "trajectories")
    await publish_spread(bus, topic)
    records = await read(bus, topic)
    assert values(await read(bus, topic, "2", "3")) == [6, 7, 8]  # offset 2 of every partition
    assert values(await read(bus, topic, "3", "99")) == [9, 10, 11]  # an end past the log: cut
    fourth = records[4].timestamp_ms
    assert values(await read(bus, topic, f"@{fourth}")) == list(range(4, COUNT))
    assert values(await read(bus, topic, "earliest", f"@{fourth}")) == [0, 1, 2, 3]
    assert await read(bus, topic, "latest") == []


def test_bounds_parse_and_bad_ones_are_refused():
    assert parse_bound("earliest") == Bound("earliest")
    assert parse_bound("17") == Bound("offset", 17)
    assert parse_bound("@1700000000000") == Bound("time", 1_700_000_000_000)
    assert parse_bound("2023-11-14T22:13:20Z") == Bound("time", 1_700_000_000_000)
    assert parse_bound("2023-11-14T22:13:20") == Bound("time", 1_700_000_000_000)  # UTC
    with pytest.raises(ConfigError, match="range bound must be"):
        parse_bound("yesterday")


@pytest.mark.kafka
async def test_a_range_the_broker_already_deleted_fails_at_once(kafka_broker):
    from aiokafka import TopicPartition
    from aiokafka.admin import AIOKafkaAdminClient, RecordsToDelete

    run = unique_run()
    topic = topic_name(run, "trajectories")
    async with open_bus(kafka_broker.url) as bus:
        await bus.create_topics(run_topics(run, trajectory_partitions=3))
        await publish_spread(bus, topic)
        admin = AIOKafkaAdminClient(bootstrap_servers=kafka_broker.bootstrap)
        await admin.start()
        try:  # what retention does to old segments: partition 0's log now starts at offset 2
            await admin.delete_records(
                {TopicPartition(topic, 0): RecordsToDelete(before_offset=2)})
        finally:
            await admin.close()
        with pytest.raises(RangeError, match=r"\[0\]: the range starts before offset 2"):
            await asyncio.wait_for(read(bus, topic, "0"), 60)
        with pytest.raises(RangeError, match="oldest record the broker still keeps"):
            await asyncio.wait_for(read(bus, topic, "@0"), 60)
        left = await read(bus, topic, "earliest")  # partition 0 lost 0 and 3
        assert values(left) == [1, 2, 4, 5, 6, 7, 8, 9, 10, 11]
