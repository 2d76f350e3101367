"""One contract, two buses: every test runs on the embedded bus (in memory and durable,
`embedded://PATH`) and on the real Kafka broker."""

from __future__ import annotations

import asyncio
import time

import pytest

from miles.bus import Bus, Consumer, Record, TopicPartition
from miles.errors import BusError, CommitFailedError, RecordTooLargeError
from miles.protocol.topics import (MAX_RECORD_BYTES, TOPIC_MAX_MESSAGE_BYTES, run_topics,
                                   topic_name)
from tests.conftest import unique_run

COLLECT_TIMEOUT_S = 30.0


@pytest.fixture(params=["embedded", "durable", pytest.param("kafka", marks=pytest.mark.kafka)])
def bus_url(request, tmp_path) -> str:
    if request.param == "durable":
        return f"embedded://{tmp_path / 'bus'}"
    if request.param == "embedded":
        return "embedded://"
    return request.getfixturevalue("kafka_broker").url


async def collect(consumer: Consumer, count: int, timeout_s: float = COLLECT_TIMEOUT_S) -> list[Record]:
    """Poll until `count` records arrived (Kafka group joins take a moment)."""
    records: list[Record] = []
    deadline = time.monotonic() + timeout_s
    while len(records) < count and time.monotonic() < deadline:
        records.extend(await consumer.poll(max_records=count - len(records), timeout_s=0.5))
    return records


async def assert_quiet(consumer: Consumer, wait_s: float = 1.0) -> None:
    assert await consumer.poll(timeout_s=wait_s) == []


async def publish_numbers(bus: Bus, topic: str, count: int, *, key_of=None) -> None:
    for i in range(count):
        key = key_of(i) if key_of else None
        await bus.publish(topic, str(i).encode(), key=key)


def values(records: list[Record]) -> list[int]:
    return [int(r.value) for r in records]


async def test_round_trip_keeps_key_headers_and_order(bus, run):
    topic = topic_name(run, "trajectories")
    deliveries = [await bus.publish(topic, f"v{i}".encode(), key=b"k",
                                    headers=[("trace", f"h{i}".encode())]) for i in range(5)]
    assert len({d.partition for d in deliveries}) == 1
    assert [d.offset for d in deliveries] == list(range(5))
    async with bus.consumer([topic], group_id=f"{run}-g") as consumer:
        records = await collect(consumer, 5)
    assert [r.value for r in records] == [f"v{i}".encode() for i in range(5)]
    assert [r.offset for r in records] == list(range(5))
    assert all(r.key == b"k" for r in records)
    assert [dict(r.headers)["trace"] for r in records] == [f"h{i}".encode() for i in range(5)]
    assert all(abs(r.timestamp_ms - time.time() * 1000) < 60_000 for r in records)


async def test_pipelined_sends_all_land_in_order_per_partition(bus, run):
    topic = topic_name(run, "trajectories")
    pending = [await bus.send(topic, str(i).encode(), key=str(i % 3).encode()) for i in range(60)]
    deliveries = await asyncio.gather(*pending)
    per_partition: dict[int, list[int]] = {}
    for d in deliveries:
        per_partition.setdefault(d.partition, []).append(d.offset)
    assert all(offsets == sorted(offsets) for offsets in per_partition.values())
    async with bus.consumer([topic], group_id=f"{run}-g") as consumer:
        records = await collect(consumer, 60)
    assert sorted(values(records)) == list(range(60))
    for partition in {r.partition for r in records}:
        in_partition = values([r for r in records if r.partition == partition])
        assert in_partition == sorted(in_partition)


async def test_same_key_same_partition(bus, run):
    topic = topic_name(run, "prompts")
    partitions = {(await bus.publish(topic, b"x", key=b"group-7")).partition for _ in range(6)}
    assert len(partitions) == 1


async def test_explicit_partition(bus, run):
    topic = topic_name(run, "prompts")
    delivery = await bus.publish(topic, b"x", partition=2)
    assert delivery.partition == 2


async def test_commit_then_new_member_resumes_after_commit(bus, run):
    topic = topic_name(run, "control")
    await publish_numbers(bus, topic, 10)
    async with bus.consumer([topic], group_id=f"{run}-g") as first:
        records = await collect(first, 10)
        assert values(records) == list(range(10))
        tp = TopicPartition(topic, 0)
        await first.commit({tp: 4})
        assert await first.committed(tp) == 4
    async with bus.consumer([topic], group_id=f"{run}-g") as second:
        assert values(await collect(second, 6)) == list(range(4, 10))
        await second.commit()
        assert await second.committed(tp) == 10
        await assert_quiet(second)


async def test_uncommitted_records_are_redelivered(bus, run):
    topic = topic_name(run, "control")
    await publish_numbers(bus, topic, 3)
    async with bus.consumer([topic], group_id=f"{run}-g") as first:
        assert values(await collect(first, 3)) == [0, 1, 2]
    async with bus.consumer([topic], group_id=f"{run}-g") as second:
        assert values(await collect(second, 3)) == [0, 1, 2]


async def test_independent_groups_each_see_everything(bus, run):
    topic = topic_name(run, "trajectories")
    await publish_numbers(bus, topic, 12, key_of=lambda i: str(i).encode())
    async with bus.consumer([topic], group_id=f"{run}-trainer") as trainer, \
            bus.consumer([topic], group_id=f"{run}-recorder") as recorder:
        assert sorted(values(await collect(trainer, 12))) == list(range(12))
        assert sorted(values(await collect(recorder, 12))) == list(range(12))


async def test_group_members_share_partitions(bus, run):
    topic = topic_name(run, "prompts")
    async with bus.consumer([topic], group_id=f"{run}-g") as one, \
            bus.consumer([topic], group_id=f"{run}-g") as two:
        deadline = time.monotonic() + COLLECT_TIMEOUT_S
        while time.monotonic() < deadline:
            await asyncio.gather(one.poll(timeout_s=0.2), two.poll(timeout_s=0.2))
            if one.assignment() and two.assignment() and \
                    len(one.assignment() | two.assignment()) == 3:
                break
        assert one.assignment() and two.assignment()
        assert not one.assignment() & two.assignment()
        await publish_numbers(bus, topic, 30, key_of=lambda i: str(i).encode())
        got: list[Record] = []
        deadline = time.monotonic() + COLLECT_TIMEOUT_S
        while len(got) < 30 and time.monotonic() < deadline:
            for batch in await asyncio.gather(one.poll(timeout_s=0.3), two.poll(timeout_s=0.3)):
                got.extend(batch)
    assert sorted(values(got)) == list(range(30))


async def test_rebalance_callbacks_report_partitions(bus, run):
    topic = topic_name(run, "prompts")
    assigned: list[set[TopicPartition]] = []
    revoked: list[set[TopicPartition]] = []

    async def on_assigned(tps):
        assigned.append(tps)

    async def on_revoked(tps):
        revoked.append(tps)

    consumer = bus.consumer([topic], group_id=f"{run}-g", on_assigned=on_assigned,
                            on_revoked=on_revoked)
    async with consumer:
        deadline = time.monotonic() + COLLECT_TIMEOUT_S
        while not assigned and time.monotonic() < deadline:
            await consumer.poll(timeout_s=0.2)
        assert assigned[-1] == {TopicPartition(topic, p) for p in range(3)}
    assert revoked and revoked[-1] == {TopicPartition(topic, p) for p in range(3)}


async def test_the_first_assignment_may_seek(bus, run):
    """A consumer that keeps its own positions seeks every partition it is given, the first
    assignment too (Kafka may hand it out while the consumer is still starting)."""
    topic = topic_name(run, "control")
    await publish_numbers(bus, topic, 6)
    holder: list = []

    async def on_assigned(tps):
        for tp in tps:
            holder[0].seek(tp, 4)

    consumer = bus.consumer([topic], group_id=f"{run}-g", on_assigned=on_assigned)
    holder.append(consumer)
    async with consumer:
        assert values(await collect(consumer, 2)) == [4, 5]


async def test_a_revocation_may_commit_and_a_moved_partition_cannot_be(bus, run):
    topic = topic_name(run, "control")
    await publish_numbers(bus, topic, 5)
    tp = TopicPartition(topic, 0)
    holder: list = []

    async def on_revoked(tps):  # on close too, before the partitions move
        await holder[0].commit({tp: 3})

    first = bus.consumer([topic], group_id=f"{run}-g", on_revoked=on_revoked)
    holder.append(first)
    async with first:
        await collect(first, 5)
    async with bus.consumer([topic], group_id=f"{run}-g") as second:
        assert values(await collect(second, 2)) == [3, 4]
        with pytest.raises(CommitFailedError):
            await second.commit({TopicPartition(topic_name(run, "prompts"), 0): 1})


async def test_seek_to_offset(bus, run):
    topic = topic_name(run, "control")
    await publish_numbers(bus, topic, 8)
    async with bus.consumer([topic], group_id=f"{run}-g") as consumer:
        assert values(await collect(consumer, 8)) == list(range(8))
        tp = TopicPartition(topic, 0)
        consumer.seek(tp, 5)
        assert await consumer.position(tp) == 5
        assert values(await collect(consumer, 3)) == [5, 6, 7]
        with pytest.raises(BusError):
            consumer.seek(TopicPartition(topic, 9), 0)


async def test_seek_to_time(bus, run):
    topic = topic_name(run, "control")
    await publish_numbers(bus, topic, 3)
    await asyncio.sleep(0.05)
    cut_ms = int(time.time() * 1000)
    await asyncio.sleep(0.05)
    await publish_numbers(bus, topic, 2)
    async with bus.consumer([topic], group_id=f"{run}-g") as consumer:
        assert len(await collect(consumer, 5)) == 5
        targets = await consumer.seek_to_time(cut_ms)
        assert targets == {TopicPartition(topic, 0): 3}
        assert values(await collect(consumer, 2)) == [0, 1]
        future = await consumer.seek_to_time(int(time.time() * 1000) + 3_600_000)
        assert future == {TopicPartition(topic, 0): 5}
        await assert_quiet(consumer, 0.5)


async def test_pause_and_resume(bus, run):
    topic = topic_name(run, "control")
    async with bus.consumer([topic], group_id=f"{run}-g") as consumer:
        await publish_numbers(bus, topic, 2)
        assert values(await collect(consumer, 2)) == [0, 1]
        tp = TopicPartition(topic, 0)
        consumer.pause(tp)
        await publish_numbers(bus, topic, 2)
        await assert_quiet(consumer, 1.0)
        consumer.resume(tp)
        assert values(await collect(consumer, 2)) == [0, 1]


async def test_latest_reset_skips_history(bus, run):
    topic = topic_name(run, "status")
    await publish_numbers(bus, topic, 3)
    consumer = bus.consumer([topic], group_id=f"{run}-g", from_beginning=False)
    async with consumer:
        deadline = time.monotonic() + COLLECT_TIMEOUT_S
        while not consumer.assignment() and time.monotonic() < deadline:
            await consumer.poll(timeout_s=0.2)
        tp = TopicPartition(topic, 0)
        assert await consumer.position(tp) == 3
        await bus.publish(topic, b"99")
        assert values(await collect(consumer, 1)) == [99]


async def test_end_and_beginning_offsets(bus, run):
    topic = topic_name(run, "control")
    await publish_numbers(bus, topic, 4)
    async with bus.consumer([topic], group_id=f"{run}-g") as consumer:
        tp = TopicPartition(topic, 0)
        assert await consumer.end_offsets([tp]) == {tp: 4}
        assert await consumer.beginning_offsets([tp]) == {tp: 0}


async def test_topic_offsets_cover_every_partition(bus, run):
    trajectories, control = topic_name(run, "trajectories"), topic_name(run, "control")
    for partition, count in ((0, 3), (2, 1)):
        for i in range(count):
            await bus.publish(trajectories, b"x", partition=partition)
    await publish_numbers(bus, control, 2)
    assert await bus.topic_offsets([trajectories, control]) == {
        TopicPartition(trajectories, 0): (0, 3), TopicPartition(trajectories, 1): (0, 0),
        TopicPartition(trajectories, 2): (0, 1), TopicPartition(control, 0): (0, 2)}
    with pytest.raises(BusError):
        await bus.topic_offsets([f"miles.{unique_run()}.dlq"])


async def test_group_offsets_list_groups_that_committed_on_the_topics(bus, run):
    trajectories, control = topic_name(run, "trajectories"), topic_name(run, "control")
    for partition in range(3):
        await bus.publish(trajectories, b"x", partition=partition)
    await publish_numbers(bus, control, 3)
    p0, p2 = TopicPartition(trajectories, 0), TopicPartition(trajectories, 2)
    c0 = TopicPartition(control, 0)
    async with bus.consumer([trajectories], group_id=f"{run}-trainer") as trainer, \
            bus.consumer([control], group_id=f"{run}-control") as other, \
            bus.consumer([trajectories], group_id=f"{run}-reader") as reader:
        for consumer, count in ((trainer, 3), (other, 3), (reader, 3)):
            await collect(consumer, count)
        await trainer.commit({p0: 1, p2: 0})
        await other.commit({c0: 2})
        offsets = await bus.group_offsets([trajectories])
        assert offsets[f"{run}-trainer"] == {p0: 1, p2: 0}
        assert f"{run}-reader" not in offsets and f"{run}-control" not in offsets
        both = await bus.group_offsets([trajectories, control])
        assert both[f"{run}-control"] == {c0: 2}
        assert await reader.position(p0) == 1  # reading offsets moved no consumer


async def test_oversized_record_fails_before_sending(bus, run):
    topic = topic_name(run, "trajectories")
    with pytest.raises(RecordTooLargeError, match=str(MAX_RECORD_BYTES)):
        await bus.publish(topic, b"x" * (MAX_RECORD_BYTES + 1))
    with pytest.raises(RecordTooLargeError):
        await bus.publish(topic, b"x" * (MAX_RECORD_BYTES // 2),
                          headers=[("pad", b"y" * (MAX_RECORD_BYTES // 2))])
    async with bus.consumer([topic], group_id=f"{run}-g") as consumer:
        await assert_quiet(consumer, 1.0)


async def test_record_near_the_limit_goes_through(bus, run):
    topic = topic_name(run, "trajectories")
    payload = bytes(range(256)) * ((MAX_RECORD_BYTES - 4096) // 256)
    await bus.publish(topic, payload, key=b"big")
    async with bus.consumer([topic], group_id=f"{run}-g") as consumer:
        [record] = await collect(consumer, 1)
    assert record.value == payload


async def test_create_topics_is_idempotent_and_describes_configs(bus):
    run = unique_run()
    specs = run_topics(run, trajectory_partitions=4)
    created = await bus.create_topics(specs)
    assert sorted(created) == sorted(s.name for s in specs)
    assert await bus.create_topics(specs) == []
    info = await bus.describe_topics([topic_name(run, "trajectories"),
                                      topic_name(run, "control")])
    trajectories = info[topic_name(run, "trajectories")]
    assert trajectories.partitions == 4
    assert trajectories.configs["max.message.bytes"] == str(TOPIC_MAX_MESSAGE_BYTES)
    assert trajectories.configs["retention.ms"] == "-1"
    assert info[topic_name(run, "control")].partitions == 1


async def test_publishing_to_a_missing_topic_is_a_clear_error(bus, monkeypatch):
    monkeypatch.setattr("miles.bus.kafka.TOPIC_LOOKUP_TIMEOUT_S", 3.0, raising=False)
    with pytest.raises(BusError, match="create it first"):
        await bus.publish(f"miles.{unique_run()}.prompts", b"x")
