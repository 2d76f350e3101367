"""Fault test: the broker goes down and comes back while records flow; nothing is lost or doubled."""

from __future__ import annotations

import asyncio
import time

import pytest

from miles.bus import Record, open_bus
from miles.errors import BusError
from miles.protocol.topics import run_topics, topic_name
from tests.conftest import unique_run

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

TOTAL = 240
PARTITIONS = 3


async def produce(bus, topic: str, halfway: asyncio.Event) -> None:
    for seq in range(TOTAL):
        key = str(seq % PARTITIONS).encode()
        await bus.publish(topic, f"{seq % PARTITIONS}:{seq}".encode(), key=key)
        if seq == TOTAL // 2:
            halfway.set()
        await asyncio.sleep(0.01)


async def consume(bus, topic: str, group: str, got: list[Record], done: asyncio.Event) -> None:
    async with bus.consumer([topic], group_id=group) as consumer:
        while len(got) < TOTAL and not done.is_set():
            records = await consumer.poll(timeout_s=0.5)
            got.extend(records)
            if records:
                try:
                    await consumer.commit()
                except BusError:
                    pass  # the broker is down; the next commit covers these records


async def test_records_survive_a_broker_restart(kafka_broker):
    if not kafka_broker.owned:
        pytest.skip("needs a broker owned by this test session (MILES_TEST_BOOTSTRAP is set)")
    run = unique_run()
    async with open_bus(kafka_broker.url) as admin_bus:
        await admin_bus.create_topics(run_topics(run, trajectory_partitions=PARTITIONS))
    topic = topic_name(run, "trajectories")
    halfway, stop_consuming = asyncio.Event(), asyncio.Event()
    got: list[Record] = []
    async with open_bus(kafka_broker.url) as bus:
        producer = asyncio.create_task(produce(bus, topic, halfway))
        consumer = asyncio.create_task(consume(bus, topic, f"{run}-g", got, stop_consuming))
        await asyncio.wait_for(halfway.wait(), 60)
        await asyncio.to_thread(kafka_broker.stop)
        assert not producer.done(), "the broker must go down while records are still flowing"
        await asyncio.sleep(1.0)
        await asyncio.to_thread(kafka_broker.start)
        await asyncio.wait_for(producer, 120)
        deadline = time.monotonic() + 90
        while len(got) < TOTAL and time.monotonic() < deadline and not consumer.done():
            await asyncio.sleep(0.2)
        stop_consuming.set()
        await asyncio.wait_for(consumer, 30)

    sequences = [int(r.value.split(b":")[1]) for r in got]
    assert len(sequences) == len(set(sequences)), "a record was delivered twice"
    assert sorted(sequences) == list(range(TOTAL)), "records were lost"
    for partition in range(PARTITIONS):
        in_partition = [int(r.value.split(b":")[1]) for r in got if r.partition == partition]
        assert in_partition == sorted(in_partition)
