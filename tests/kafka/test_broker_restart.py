"""Fault test: the broker goes down and comes back while records flow; nothing is lost or doubled."""

from __future__ import annotations

import asyncio
import logging
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


async def test_records_survive_a_broker_restart(kafka_broker, caplog):
    """Also: the outage is logged as one reconnect line per target, not one per attempt."""
    caplog.set_level(logging.INFO, logger="aiokafka")
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
    failures = [r for r in caplog.records if r.getMessage().startswith("Unable connect")]
    targets = {r.getMessage().split(":")[0] for r in failures}
    assert failures and len(failures) <= 2 * len(targets), [r.getMessage() for r in failures]


async def test_a_client_started_while_the_broker_is_down_waits_for_it(kafka_broker):
    """A daemon (re)started during a broker restart connects once the broker is back."""
    if not kafka_broker.owned:
        pytest.skip("needs a broker owned by this test session (MILES_TEST_BOOTSTRAP is set)")
    run = unique_run()
    async with open_bus(kafka_broker.url) as admin_bus:
        await admin_bus.create_topics(run_topics(run))
    await asyncio.to_thread(kafka_broker.stop)
    try:
        bus = open_bus(kafka_broker.url)
        starting = asyncio.create_task(bus.start())
        await asyncio.sleep(3.0)
        assert not starting.done(), "start gave up while the broker was down"
    finally:
        await asyncio.to_thread(kafka_broker.start)
    await asyncio.wait_for(starting, 60)
    try:
        delivery = await bus.publish(topic_name(run, "status"), b"after the restart")
        assert delivery.offset == 0
        async with bus.consumer([topic_name(run, "status")], group_id=f"{run}-g") as consumer:
            records = []
            deadline = time.monotonic() + 30
            while not records and time.monotonic() < deadline:
                records = await consumer.poll(timeout_s=0.5)
        assert [r.value for r in records] == [b"after the restart"]
    finally:
        await bus.close()
