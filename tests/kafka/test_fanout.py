"""Fan-out consumers on the real broker: they read a live run in groups of their own."""

from __future__ import annotations

import asyncio
import json

import pytest

from miles.bus import open_bus
from miles.protocol import DeadLetter, decode, encode
from miles.protocol.topics import run_topics, topic_name
from miles.trainer import distributed
from miles.trainer.learner import Learner
from miles.trainer.model import LoraSettings
from miles.weights.following import FollowConfig
from miles.weights.store import write_version
from tests.conftest import unique_run
from tests.factories import make_command, make_group
from tests.kafka.raw_client import RawProducer

pytestmark = pytest.mark.kafka
LORA = LoraSettings(r=4, alpha=8)


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def wait_for(predicate, timeout_s: float = 90.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.2)


async def test_evaluator_scores_the_stream_and_measures_each_new_version(kafka_broker,
                                                                         model_dir, tmp_path):
    from consumers.evaluator import EvaluatorSettings, run_evaluator

    run = unique_run()
    learner = Learner(model_dir, lora=LORA)  # only to export a real adapter as version 1
    learner.policy_version = 1
    record = write_version(tmp_path / "weights", policy_version=1, step=1,
                           base_model=str(model_dir), write=learner.export_weights)
    distributed.destroy()
    settings = EvaluatorSettings(bus=kafka_broker.url, run=run, model_dir=model_dir, lora=LORA,
                                 eval_problems=20, every_s=0.5, out=tmp_path / "eval.jsonl",
                                 weights=FollowConfig(store=tmp_path / "weights"))
    stop = asyncio.Event()
    async with open_bus(kafka_broker.url) as bus:
        await bus.create_topics(run_topics(run, trajectory_partitions=2))
        evaluating = asyncio.create_task(run_evaluator(settings, stop))
        await wait_for(lambda: lines(settings.out))  # it is reading
        trajectories = topic_name(run, "trajectories")
        for i in range(4):  # versions 2, 2, 3, 3 (oldest token), rewards from the factory
            await bus.publish(trajectories, encode(make_group(4, 5, vocab_size=78, seed=i,
                                                              policy_version=2 + i // 2)))
        await bus.publish(trajectories, b"\x00garbage")
        async with RawProducer(kafka_broker.bootstrap) as raw:
            await raw.send(trajectories, None)  # a tombstone: counted as invalid
            await raw.send(topic_name(run, "control"), None)  # dead-lettered
        await bus.publish(topic_name(run, "control"), encode(make_command()))  # not read: skipped
        await bus.publish(topic_name(run, "control"), encode(record))
        await wait_for(lambda: any(x["kind"] == "held_out" for x in lines(settings.out))
                       and lines(settings.out)[-1].get("by_version", {}).get("3"))
        await wait_for(lambda: lines(settings.out)[-1]["invalid"] == 2)
        stop.set()
        summary = await asyncio.wait_for(evaluating, 60)
        async with bus.consumer([topic_name(run, "dlq")], group_id="audit") as audit:
            letters = [decode(r.value, DeadLetter) for r in await audit.poll(timeout_s=5)]
    held_out = [x for x in lines(settings.out) if x["kind"] == "held_out"]
    assert [x["policy_version"] for x in held_out] == [1] and 0 <= held_out[0]["accuracy"] <= 1
    stream = [x for x in lines(settings.out) if x["kind"] == "stream"][-1]
    assert {v: s["groups"] for v, s in stream["by_version"].items()} == {"2": 2, "3": 2}
    assert summary == {"measurements": 1, "invalid": 2}
    assert [(x.consumer_group, "tombstone" in x.reason) for x in letters] == [
        (f"miles.{run}.fanout-evaluator.control", True)]  # the command is no dead letter


async def test_recorder_archives_every_sample_once_and_resumes_after_its_commit(kafka_broker,
                                                                               tmp_path):
    import pyarrow.parquet as pq

    from consumers.recorder import RecorderSettings, run_recorder

    run = unique_run()
    settings = RecorderSettings(bus=kafka_broker.url, run=run, out_dir=tmp_path / "archive",
                                file_rows=12, file_seconds=1.0)

    def archived() -> list[dict]:
        return [row for path in sorted(settings.out_dir.glob("part-*.parquet"))
                for row in pq.read_table(path).to_pylist()]

    async with open_bus(kafka_broker.url) as bus:
        await bus.create_topics(run_topics(run, trajectory_partitions=2))
        trajectories = topic_name(run, "trajectories")

        async def publish(seeds) -> None:
            for i in seeds:
                await bus.publish(trajectories, encode(make_group(4, 5, vocab_size=78, seed=i)))

        await publish(range(5))
        await bus.publish(trajectories, b"\x00garbage")
        async with RawProducer(kafka_broker.bootstrap) as raw:
            await raw.send(trajectories, None)  # a tombstone
        stop = asyncio.Event()
        recording = asyncio.create_task(run_recorder(settings, stop))
        await wait_for(lambda: len(archived()) == 20)
        stop.set()
        first = await asyncio.wait_for(recording, 60)
        await publish(range(5, 7))  # while no recorder runs
        stop = asyncio.Event()
        recording = asyncio.create_task(run_recorder(settings, stop))
        await wait_for(lambda: len(archived()) == 28)
        await asyncio.sleep(1.5)  # one more file period: nothing is written twice
        stop.set()
        second = await asyncio.wait_for(recording, 60)
    rows = archived()
    assert len(rows) == 28 and first["invalid"] == 2 and second["invalid"] == 0
    assert len({(r["group_id"], r["sample_index"]) for r in rows}) == 28
    assert first["files"] >= 1 and second["files"] >= 1
    assert rows[0]["versions"] and isinstance(rows[0]["logprobs"][0], float)
