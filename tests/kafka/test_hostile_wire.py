"""Records a foreign client can write that Miles never would, on the real broker (the wire side;
the trainer's semantic rules are in test_hostile_records.py): tombstones on every topic, 8 MiB of
empty containers, a huge ignored map, a prompt outside the vocabulary. No consumer dies, each is
dead-lettered once, and decoding never stalls the event loop."""

from __future__ import annotations

import asyncio
import struct
import time

import msgpack
import numpy as np
import pytest

from miles import rollout
from miles.bus import open_bus
from miles.bus.decoding import DecodingConsumer
from miles.protocol import (MAX_RECORD_BYTES, MAX_SAMPLES_PER_GROUP, Command, DeadLetter,
                            Heartbeat, PromptTask, TrajectoryGroup, WeightVersion, decode, encode)
from miles.engines.base import LoraSettings
from miles.engines.hf import HFEngine
from miles.protocol.topics import run_topics, topic_name
from miles.rl.sampling import SamplingParams
from miles.rollout import RolloutConfig, RolloutWorker
from miles.tasks.rewards import Scorer
from tests.conftest import unique_run
from tests.factories import make_group, make_heartbeat, make_prompt_task, make_weight_version
from tests.kafka.raw_client import RawProducer
from tests.rewards import starts_with_digit

pytestmark = pytest.mark.kafka
MAX_STALL_S = 1.0  # longest the loop may go without running another task (~0.1 s measured)


async def letters_of(bus, run: str, count: int, timeout_s: float = 60) -> list[DeadLetter]:
    async with bus.consumer([topic_name(run, "dlq")], group_id=f"{run}-audit") as audit:
        records, deadline = [], time.monotonic() + timeout_s
        while len(records) < count and time.monotonic() < deadline:
            records.extend(await audit.poll(timeout_s=0.5))
        records.extend(await audit.poll(timeout_s=1.0))  # and nothing more
    return [decode(r.value, DeadLetter) for r in records]


async def drain(reader: DecodingConsumer, count: int, timeout_s: float = 60) -> list:
    got, deadline = [], time.monotonic() + timeout_s
    while reader.counts["bus/records"] < count and time.monotonic() < deadline:
        got.extend(await reader.poll(timeout_s=0.5))
    return got


# (topic kind, group, what the group reads, a valid record) for each decoding consumer of a run
READERS = [
    ("trajectories", "trainer", TrajectoryGroup, lambda: make_group()),
    ("prompts", "producers", PromptTask, lambda: make_prompt_task()),
    ("control", "producer-0.control", (WeightVersion, Command), lambda: make_weight_version()),
    ("control", "fanout-evaluator.control", WeightVersion, lambda: make_weight_version()),
    ("status", "producer-0.status", Heartbeat, lambda: make_heartbeat()),
]


async def test_a_tombstone_on_each_topic_is_dead_lettered_by_each_reader(kafka_broker):
    run = unique_run()
    async with open_bus(kafka_broker.url) as bus, RawProducer(kafka_broker.bootstrap) as raw:
        await bus.create_topics(run_topics(run, prompt_partitions=1, trajectory_partitions=1))
        for kind in dict.fromkeys(kind for kind, *_ in READERS):
            await raw.send(topic_name(run, kind), None)
        for kind, _, _, valid in READERS:
            await bus.publish(topic_name(run, kind), encode(valid()))
        for kind, group, reads, _ in READERS:
            topic = topic_name(run, kind)
            per_topic = sum(k == kind for k, *_ in READERS)
            async with bus.consumer([topic], group_id=f"miles.{run}.{group}") as consumer:
                reader = DecodingConsumer(bus, consumer, dlq_topic=topic_name(run, "dlq"),
                                          expected=reads)
                got = await drain(reader, 1 + per_topic)
            assert len(got) == per_topic and reader.counts["bus/dlq_records"] == 1, group
        letters = await letters_of(bus, run, len(READERS))
    assert sorted(letter.consumer_group for letter in letters) == sorted(
        f"miles.{run}.{group}" for _, group, *_ in READERS)
    assert all("tombstone" in letter.reason and letter.payload_size == 0 for letter in letters)


def empty_containers(total_bytes: int) -> bytes:
    """A trajectory group's envelope whose ignored field holds ~`total_bytes` empty arrays."""
    inner = msgpack.packb([[]] * (MAX_SAMPLES_PER_GROUP - 1))
    n = total_bytes // len(inner)
    good = encode(make_group())
    return (bytes([good[0] + 1]) + good[1:] + msgpack.packb("junk") + b"\xdc"
            + struct.pack(">H", n) + inner * n)


def huge_map(entries: int) -> bytes:
    keys = (bytes([0xA3, a, b, c]) for a in range(128) for b in range(128) for c in range(128))
    body = b"".join(key + b"\x00" for _, key in zip(range(entries), keys))
    good = encode(make_group())
    return (bytes([good[0] + 1]) + good[1:] + msgpack.packb("junk") + b"\xdf"
            + struct.pack(">I", entries) + body)


async def longest_stall(work) -> float:
    """The longest gap between two ticks of a task that wakes every 10 ms while `work` runs."""
    gaps, done = [0.0], asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticking = asyncio.create_task(ticker())
    try:
        await work()
    finally:
        done.set()
        await ticking
    return max(gaps)


async def test_hostile_records_neither_pass_nor_stall_the_loop(kafka_broker):
    run = unique_run()
    trajectories = topic_name(run, "trajectories")
    hostile = [empty_containers(MAX_RECORD_BYTES - 8192), empty_containers(MAX_RECORD_BYTES - 8192),
               huge_map(1_400_000)]
    assert all(len(value) < MAX_RECORD_BYTES - 1024 for value in hostile)
    async with open_bus(kafka_broker.url) as bus, RawProducer(kafka_broker.bootstrap) as raw:
        await bus.create_topics(run_topics(run, trajectory_partitions=1))
        for value in hostile:
            await raw.send(trajectories, value)
        await bus.publish(trajectories, encode(make_group(seed=5)))
        async with bus.consumer([trajectories], group_id=f"miles.{run}.trainer") as consumer:
            reader = DecodingConsumer(bus, consumer, dlq_topic=topic_name(run, "dlq"),
                                      expected=TrajectoryGroup)
            got: list = []

            async def read() -> None:
                got.extend(await drain(reader, len(hostile) + 1))

            stall = await longest_stall(read)
        letters = await letters_of(bus, run, len(hostile))
    print(f"longest event-loop stall while polling the hostile records: {stall:.3f} s")
    assert [d.value.group_id for d in got] == ["g-5"]
    assert [letter.reason.split(" ")[1] for letter in letters] == [
        "more", "more", "1400000"], [letter.reason for letter in letters]
    assert stall < MAX_STALL_S, stall


async def test_a_producer_dead_letters_a_prompt_outside_its_vocabulary_once_and_goes_on(
        kafka_broker, model_dir, monkeypatch):
    monkeypatch.setattr(rollout, "ENGINE_RETRY_S", 0.1)
    run = unique_run()
    engine = HFEngine(model_dir, lora=LoraSettings(r=4, alpha=8))
    outside = np.array([1, engine.vocab_size + 5], np.int32)
    good = [make_prompt_task(task_id=f"t{i}", prompt=f"{i}+1=") for i in range(3)]
    async with open_bus(kafka_broker.url) as bus, RawProducer(kafka_broker.bootstrap) as raw:
        await bus.create_topics(run_topics(run, prompt_partitions=1, trajectory_partitions=1))
        prompts = topic_name(run, "prompts")
        bad = await bus.publish(prompts, encode(make_prompt_task(task_id="bad",
                                                                 prompt_token_ids=outside)))
        await raw.send(prompts, None)
        await raw.send(topic_name(run, "control"), None)
        for task in good:
            await bus.publish(prompts, encode(task))
        worker = RolloutWorker(bus, engine, Scorer(starts_with_digit), RolloutConfig(
            run=run, sampling=SamplingParams(n=2, max_new_tokens=3), prompts_per_batch=4,
            max_staleness=1000, heartbeat_s=60))
        stop = asyncio.Event()
        running = asyncio.create_task(worker.run(stop))
        try:
            await until(lambda: worker.counts["producer/groups"] >= len(good), running)
            await raw.send(topic_name(run, "status"), None)  # status is read from its end
            await asyncio.sleep(1.0)  # time to retry anything, or to die
            assert not running.done(), running
        finally:
            stop.set()
            await asyncio.wait_for(running, 30)
        letters = await letters_of(bus, run, 4)
    assert worker.counts["producer/groups"] == len(good)
    assert worker.counts["producer/bad_prompts"] == 1
    assert worker.counts["producer/engine_errors"] == 0
    about_bad = [x for x in letters if x.source_topic == prompts and x.source_offset == bad.offset]
    assert len(about_bad) == 1 and f"outside [0, {engine.vocab_size})" in about_bad[0].reason
    assert (about_bad[0].consumer_group, about_bad[0].consumer) == (f"miles.{run}.producers",
                                                                    "producer-0")
    tombstones = sorted(x.consumer_group for x in letters if "tombstone" in x.reason)
    assert tombstones == sorted(f"miles.{run}.{g}" for g in ("producer-0.control", "producers",
                                                             "producer-0.status"))


async def until(predicate, running: asyncio.Task, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert not running.done(), running
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)
