"""Control-plane integrity on the real broker, with a real producer loop: a forged record on the
control or status topic changes nothing a producer follows (finding 8), a weight URI outside
the weight store is never read (finding 9), and with the trainer's public key configured only
records signed by its private key move a producer."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from dataclasses import replace
from pathlib import Path

import pytest

from miles.bus import open_bus
from miles.engines.base import LoraSettings
from miles.engines.hf import HFEngine
from miles.feeder import feed
from miles.protocol import MAX_POLICY_VERSION, Command, Heartbeat, encode
from miles.protocol.topics import run_topics, topic_name
from miles.rl.sampling import SamplingParams
from miles.rollout import RolloutConfig, RolloutWorker
from miles.tasks.arithmetic import arithmetic_problems
from miles.tasks.rewards import Scorer
from miles.weights.following import FollowConfig
from miles.weights.signing import Signer, generate_key_pair
from miles.weights.store import base_model_id
from tests.conftest import unique_run
from tests.integration.test_weight_loading import versions  # noqa: F401 (fixture)
from tests.rewards import starts_with_digit

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
LORA = LoraSettings(r=4, alpha=8)


class Producer:
    """One in-process rollout worker on the real broker (admission as in a run: staleness 1)."""

    def __init__(self, bus, run: str, model_dir, store, **settings):
        self.bus, self.run = bus, run
        self.engine = HFEngine(model_dir, lora=LORA)
        self.worker = RolloutWorker(bus, self.engine, Scorer(starts_with_digit), RolloutConfig(
            run=run, base_model=base_model_id(model_dir), sampling=SamplingParams(
                n=1, max_new_tokens=2), prompts_per_batch=2, max_staleness=1, heartbeat_s=60,
            weights=FollowConfig(store=store, **settings)))
        self.stop = asyncio.Event()
        self.task = asyncio.create_task(self.worker.run(self.stop))

    async def control(self, record) -> None:
        await self.bus.publish(topic_name(self.run, "control"), encode(record), key=b"weights")

    async def status(self, record) -> None:
        await self.bus.publish(topic_name(self.run, "status"), encode(record), key=b"trainer")

    async def until(self, predicate, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if self.task.done():
                self.task.result()
                raise AssertionError("the producer stopped on its own")
            assert time.monotonic() < deadline, "timed out"
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        self.stop.set()
        await asyncio.wait_for(self.task, 60)


@contextlib.asynccontextmanager
async def running_producer(url: str, run: str, model_dir, store, **settings):
    """A `Producer` on fresh topics of `run`, stopped on the way out."""
    async with open_bus(url) as bus:
        await bus.create_topics(run_topics(run, prompt_partitions=1, trajectory_partitions=1))
        producer = Producer(bus, run, model_dir, store, **settings)
        try:
            yield producer
        finally:
            await producer.close()


async def test_a_forged_huge_version_changes_nothing_and_real_versions_are_still_followed(
        kafka_broker, model_dir, versions):
    store, records = versions
    run = unique_run()
    async with running_producer(kafka_broker.url, run, model_dir, store) as producer:
        await producer.control(records[1])
        await producer.until(lambda: producer.engine.policy_version == 1)
        forged = replace(records[2], policy_version=MAX_POLICY_VERSION, sha256="0" * 64)
        await producer.control(forged)
        await producer.until(lambda: producer.worker.counts["producer/weight_errors"] == 1)
        assert producer.worker.trainer.policy_version == 1  # the bound did not move
        for v in (2, 3):
            await producer.control(records[v])
            await producer.until(lambda: producer.engine.policy_version == v)
        await feed(producer.bus, run, arithmetic_problems("train")[:4], shuffle=False)
        await producer.until(lambda: producer.worker.counts["producer/groups"] == 4)
        assert producer.worker.counts["producer/weight_errors"] == 1
        assert producer.worker.trainer.policy_version == 3


async def test_a_uri_outside_the_weight_store_is_never_read(kafka_broker, model_dir, versions,
                                                              caplog):
    store, records = versions
    passwd = Path("/etc/passwd").read_bytes()
    forged = replace(records[2], uri="file:///etc/passwd", bytes=len(passwd),
                     sha256=hashlib.sha256(passwd).hexdigest())  # integrity checks pass
    run = unique_run()
    async with running_producer(kafka_broker.url, run, model_dir, store) as producer:
        await producer.control(records[1])
        await producer.until(lambda: producer.engine.policy_version == 1)
        await producer.control(forged)
        await producer.until(lambda: producer.worker.counts["producer/weight_errors"] == 1)
        await producer.control(records[3])
        await producer.until(lambda: producer.engine.policy_version == 3)
    rejected = [r.message for r in caplog.records if "rejected" in r.message]
    assert len(rejected) == 1 and "outside the weight store" in rejected[0], rejected


def trainer_beat(policy_version: int, generation: int) -> Heartbeat:
    return Heartbeat(producer_id="trainer", role="trainer", engine="fsdp2",
                     policy_version=policy_version, trainer_generation=generation,
                     extra={"consumed": 0}, created_at=time.time())


async def test_with_a_public_key_only_the_trainer_s_signatures_move_a_producer(
        kafka_broker, model_dir, versions, tmp_path):
    store, records = versions
    trainer_key, public_key = generate_key_pair(tmp_path / "trainer")
    trainer, other = Signer(trainer_key), Signer(generate_key_pair(tmp_path / "other")[0])
    run = unique_run()
    async with running_producer(kafka_broker.url, run, model_dir, store, public_key=public_key) as producer:
        worker = producer.worker
        await producer.control(trainer.sign(records[1]))
        await producer.until(lambda: producer.engine.policy_version == 1)
        await producer.control(other.sign(records[2]))  # another key
        await producer.control(records[3])  # unsigned
        await producer.until(lambda: worker.counts["producer/weight_errors"] == 2)
        await producer.status(other.sign(trainer_beat(5, generation=MAX_POLICY_VERSION)))
        await producer.status(trainer_beat(5, generation=MAX_POLICY_VERSION))
        await producer.control(other.sign(Command(command="stop", created_at=time.time())))
        await producer.control(Command(command="pause", created_at=time.time()))
        await producer.until(lambda: worker.counts["producer/unverified"] == 6)
        assert (producer.engine.policy_version, worker.trainer.policy_version,
                worker.trainer.generation, worker.follower.announced.generation) == (1, 1, 0, 0)
        assert not worker.paused and not producer.stop.is_set()
        await producer.status(trainer.sign(trainer_beat(4, generation=0)))
        await producer.until(lambda: worker.trainer.policy_version == 4)
        await producer.control(trainer.sign(records[4]))  # still followed
        await producer.until(lambda: producer.engine.policy_version == 4)
        await feed(producer.bus, run, arithmetic_problems("train")[:2], shuffle=False)
        await producer.until(lambda: worker.counts["producer/groups"] == 2)
        await producer.control(trainer.sign(Command(command="pause",
                                                    created_at=time.time())))
        await producer.until(lambda: worker.paused)
