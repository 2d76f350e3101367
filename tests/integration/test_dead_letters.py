"""Bad records never stop a decoding consumer and are never silently lost: they go to the DLQ."""

from __future__ import annotations

import time

import msgpack
import numpy as np

from miles.bus import TopicPartition
from miles.bus.decoding import DecodingConsumer
from miles.protocol import DeadLetter, TrajectoryGroup, WeightVersion, decode, encode
from miles.protocol.topics import topic_name
from tests.factories import make_command, make_group, make_prompt_task, make_weight_version


def _tamper(record: bytes, edit) -> bytes:
    """Re-pack a valid encoding after `edit` changed its msgpack map in place."""
    envelope = msgpack.unpackb(record, raw=False)
    edit(envelope)
    return msgpack.packb(envelope, use_bin_type=True)


def _nan_logprobs(envelope: dict) -> None:
    logprobs = envelope["samples"][0]["logprobs"]
    values = np.frombuffer(logprobs["data"], dtype="<f4").copy()
    values[1] = np.nan
    logprobs["data"] = values.tobytes()


def _positive_logprobs(envelope: dict) -> None:
    logprobs = envelope["samples"][0]["logprobs"]
    values = np.frombuffer(logprobs["data"], dtype="<f4").copy()
    values[0] = 0.5
    logprobs["data"] = values.tobytes()


def _length_mismatch(envelope: dict) -> None:
    envelope["samples"][0]["versions"]["length"] += 1


def _newer_schema(envelope: dict) -> None:
    envelope["schema"] = [99, 0]


def bad_records() -> dict[str, bytes]:
    good = encode(make_group())
    return {
        "garbage": b"\x00\xff garbage \xc1",
        "truncated": good[: len(good) // 3],
        "wrong record type": encode(make_prompt_task()),
        "nan logprob": _tamper(good, _nan_logprobs),
        "positive logprob": _tamper(good, _positive_logprobs),
        "length mismatch": _tamper(good, _length_mismatch),
        "newer schema": _tamper(good, _newer_schema),
        "not a map": msgpack.packb([1, 2, 3]),
    }


async def test_bad_records_are_dead_lettered_and_good_ones_flow(bus, run):
    trajectories, dlq = topic_name(run, "trajectories"), topic_name(run, "dlq")
    bad = bad_records()
    sent: dict[int, str] = {}
    await bus.publish(trajectories, encode(make_group(seed=1)), partition=0)
    for name, payload in bad.items():
        delivery = await bus.publish(trajectories, payload, partition=0)
        sent[delivery.offset] = name
    await bus.publish(trajectories, encode(make_group(seed=2)), partition=0)

    async with bus.consumer([trajectories], group_id=f"{run}-trainer") as consumer:
        reader = DecodingConsumer(bus, consumer, dlq_topic=dlq, expected=TrajectoryGroup)
        good = []
        deadline = time.monotonic() + 30
        while reader.counts["bus/records"] < len(bad) + 2 and time.monotonic() < deadline:
            good.extend(await reader.poll(timeout_s=0.5))
        await consumer.commit()

    assert [d.value.group_id for d in good] == ["g-1", "g-2"]
    assert reader.counts["bus/dlq_records"] == len(bad)

    async with bus.consumer([dlq], group_id=f"{run}-audit") as audit:
        letters = []
        deadline = time.monotonic() + 30
        while len(letters) < len(bad) and time.monotonic() < deadline:
            letters.extend(decode(r.value, DeadLetter) for r in await audit.poll(timeout_s=0.5))
    assert sorted(letter.source_offset for letter in letters) == sorted(sent)
    by_name = {sent[letter.source_offset]: letter for letter in letters}
    for name, letter in by_name.items():
        assert letter.source_topic == trajectories
        assert letter.source_partition == 0
        assert letter.payload == bad[name]
        assert letter.reason
    assert "schema" in by_name["newer schema"].reason
    assert "logprobs" in by_name["nan logprob"].reason
    assert "logprobs" in by_name["positive logprob"].reason
    assert "prompt_task" in by_name["wrong record type"].reason


async def test_commit_moves_past_dead_lettered_records(bus, run):
    trajectories, dlq = topic_name(run, "trajectories"), topic_name(run, "dlq")
    await bus.publish(trajectories, b"junk", partition=0)
    await bus.publish(trajectories, encode(make_group(seed=3)), partition=0)
    async with bus.consumer([trajectories], group_id=f"{run}-g") as consumer:
        reader = DecodingConsumer(bus, consumer, dlq_topic=dlq, expected=TrajectoryGroup)
        got = []
        deadline = time.monotonic() + 30
        while not got and time.monotonic() < deadline:
            got.extend(await reader.poll(timeout_s=0.5))
        await consumer.commit()
    async with bus.consumer([trajectories], group_id=f"{run}-g") as again:
        tp = TopicPartition(trajectories, 0)
        assert await again.committed(tp) == 2
        assert await again.poll(timeout_s=2.0) == []


async def read_letters(bus, run: str, count: int, timeout_s: float = 30) -> list:
    """The first `count` records of the run's DLQ (and anything else already there), decoded."""
    async with bus.consumer([topic_name(run, "dlq")], group_id=f"{run}-audit") as audit:
        records = []
        deadline = time.monotonic() + timeout_s
        while len(records) < count and time.monotonic() < deadline:
            records.extend(await audit.poll(timeout_s=0.5))
        records.extend(await audit.poll(timeout_s=0.5))  # none more
    return [(r.key, decode(r.value, DeadLetter)) for r in records]


async def poll_all(reader: DecodingConsumer, count: int, timeout_s: float = 30) -> list:
    got, deadline = [], time.monotonic() + timeout_s
    while reader.counts["bus/records"] < count and time.monotonic() < deadline:
        got.extend(await reader.poll(timeout_s=0.5))
    return got


async def test_one_letter_per_record_per_group_naming_the_consumer(bus, run):
    trajectories, dlq = topic_name(run, "trajectories"), topic_name(run, "dlq")
    bad = await bus.publish(trajectories, b"junk", partition=0)
    await bus.publish(trajectories, encode(make_group(seed=1)), partition=0)
    for group, name in ((f"miles.{run}.trainer", "trainer"), (f"miles.{run}.other", None)):
        async with bus.consumer([trajectories], group_id=group) as consumer:
            reader = DecodingConsumer(bus, consumer, dlq_topic=dlq, expected=TrajectoryGroup,
                                      name=name)
            await poll_all(reader, 2)
            consumer.seek(TopicPartition(trajectories, 0), 0)  # read again: no second letter
            await poll_all(reader, 4)
            assert reader.counts["bus/dlq_records"] == 1
            assert reader.counts["bus/dlq_repeats"] == 1
    letters = await read_letters(bus, run, 2)
    assert [(key, letter.consumer_group, letter.consumer) for key, letter in letters] == [
        (f"miles.{run}.trainer/{trajectories}/0/{bad.offset}".encode(), f"miles.{run}.trainer",
         "trainer"),
        (f"miles.{run}.other/{trajectories}/0/{bad.offset}".encode(), f"miles.{run}.other",
         f"miles.{run}.other")]
    assert all(key == letter.key for key, letter in letters)


async def test_records_the_topic_carries_but_the_consumer_does_not_read_are_skipped(bus, run):
    control, dlq = topic_name(run, "control"), topic_name(run, "dlq")
    await bus.publish(control, encode(make_command()))
    await bus.publish(control, encode(make_weight_version()))
    await bus.publish(control, encode(make_group()))  # not a record of the control topic
    async with bus.consumer([control], group_id=f"miles.{run}.evaluator.control") as consumer:
        reader = DecodingConsumer(bus, consumer, dlq_topic=dlq, expected=WeightVersion)
        got = await poll_all(reader, 3)
    assert [type(d.value) for d in got] == [WeightVersion]
    assert reader.counts["bus/skipped_records"] == 1
    assert reader.counts["bus/dlq_records"] == 1
    [(_, letter)] = await read_letters(bus, run, 1)
    assert "expected weight_version or command, got trajectory_group" in letter.reason
