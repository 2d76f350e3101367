"""Hostile trajectory groups from a foreign-style producer, against the real trainer process.

The records are hand-built msgpack maps (the layout of `docs/wire-format.md`), sent with
aiokafka's own producer: nothing of Miles writes them. Each hostile group is valid on the wire
(the codec accepts it) and breaks one rule of what the trainer admits ("What the trainer
admits"); good groups are interleaved. Before the intake rules, the temperature-0 group alone
ended the run, and a restarted trainer died on it again.

Asserted: the trainer never dies, nor does a trainer restarted from no checkpoint that reads the
same records again; every hostile record is dead-lettered by each of them with a reason naming
its field; none is trained; every good group is trained exactly once.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
from aiokafka import AIOKafkaProducer

from miles.bus import open_bus
from miles.protocol import DeadLetter, decode
from miles.protocol.topics import run_topics, topic_name
from tests.accounting import TINY_VOCAB_SIZE, ledger
from tests.conftest import unique_run
from tests.kafka.test_rl_processes import spawn, trainer_settings, wait_exit

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
PER_STEP = 2
BUDGET = 32  # learner.max_tokens_per_micro_batch of the trainer under test
PROMPT = [5, 6, 7, 8]
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 3}


def array(values, dtype: str) -> dict:
    """A wire array: `{dtype, length, data}`, little-endian."""
    return {"dtype": dtype, "length": len(values), "data": np.asarray(values, dtype).tobytes()}


def sample(reward: float, *, tokens: int = 3, version: int = 0, ids=None, **fields) -> dict:
    ids = list(range(10, 10 + tokens)) if ids is None else ids
    return {"response_token_ids": array(ids, "<i4"),
            "logprobs": array([-0.5] * len(ids), "<f4"),
            "versions": array([version] * len(ids), "<i4"),
            "reward": float(reward), "finish_reason": "stop", **fields}


def group(group_id: str, *, samples=None, sampling=None, **fields) -> bytes:
    record = {"type": "trajectory_group", "schema": [1, 2], "group_id": group_id,
              "task_id": f"task-{group_id}", "prompt_token_ids": array(PROMPT, "<i4"),
              "samples": samples or [sample(r) for r in (0.0, 1.0, 0.0, 1.0)],
              "producer_id": "foreign-0", "engine": "foreign", "vocab_size": TINY_VOCAB_SIZE,
              "sampling": SAMPLING | (sampling or {}), "created_at": time.time(), **fields}
    return msgpack.packb(record, use_bin_type=True)


HOSTILE = {  # name: (the field its dead letter names, the record)
    "temperature-0": ("sampling.temperature", group("h-temperature-0",
                                                    sampling={"temperature": 0})),
    "temperature-tiny": ("sampling.temperature", group("h-temperature-tiny",
                                                       sampling={"temperature": 1e-300})),
    "top-k-abc": ("sampling.top_k", group("h-top-k-abc", sampling={"top_k": "abc"})),
    "max-new-tokens-abc": ("sampling.max_new_tokens",
                           group("h-max-new-tokens-abc", sampling={"max_new_tokens": "abc"})),
    "vocab-1000": ("vocab_size", group(
        "h-vocab-1000", vocab_size=1000, prompt_token_ids=array([900, 950, 990, 999], "<i4"),
        samples=[sample(r, ids=[980, 999, 901]) for r in (0.0, 1.0)])),
    "row-over-budget": ("samples[1].response_token_ids", group(
        "h-row-over-budget", samples=[sample(0.0), sample(1.0, tokens=BUDGET - len(PROMPT) + 1)])),
    "response-60k": ("samples[0].response_token_ids", group(
        "h-response-60k", samples=[sample(0.0, ids=[11] * 60_000), sample(1.0)])),
    "version-1000": ("samples[0].versions", group(
        "h-version-1000", samples=[sample(0.0, version=1000), sample(1.0)])),
    "version-int32-max": ("samples[0].versions", group(  # every token: a negative lag
        "h-version-int32-max", samples=[sample(r, version=2**31 - 1) for r in (0.0, 1.0)])),
    "reward-1e308": ("samples[0].reward", group(
        "h-reward-1e308", samples=[sample(1e308), sample(0.0)])),
    "reward-minus-1e308": ("samples[1].reward", group(
        "h-reward-minus-1e308", samples=[sample(0.0), sample(-1e308)])),
    "token-reward-1e30": ("samples[0].token_rewards", group(
        "h-token-reward-1e30", samples=[sample(0.0, token_rewards=array([0, 1e30, 0], "<f4")),
                                        sample(1.0)])),
}


async def publish_interleaved(bootstrap: str, topic: str) -> tuple[list[str], dict[int, str]]:
    """A good group, then two hostile ones and a good one until the hostile run out, then good
    ones to fill the last step. Returns the good ids and the hostile names by offset."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, max_request_size=4 << 20)
    await producer.start()
    good, hostile = [], {}
    try:
        async def send_good() -> None:
            good.append(f"good-{len(good):02d}")
            await producer.send_and_wait(topic, group(good[-1]), partition=0)

        await send_good()
        for i, (name, (_, record)) in enumerate(HOSTILE.items()):
            sent = await producer.send_and_wait(topic, record, partition=0)
            hostile[sent.offset] = name
            if i % 2:
                await send_good()
        while len(good) % PER_STEP:
            await send_good()
    finally:
        await producer.stop()
    return good, hostile


async def dead_letters(url: str, run: str, count: int, timeout_s: float = 120) -> list:
    """The first `count` dead letters of the run (fewer if `timeout_s` passes first)."""
    letters = []
    async with open_bus(url) as bus:
        async with bus.consumer([topic_name(run, "dlq")], group_id=unique_run()) as audit:
            deadline = time.monotonic() + timeout_s
            while len(letters) < count and time.monotonic() < deadline:
                letters += [decode(r.value, DeadLetter) for r in await audit.poll(timeout_s=0.5)]
    return letters


async def wait_until(predicate, process, log: Path, what: str, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert process.poll() is None, f"the trainer died before {what}:\n" + \
            log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


def assert_dead_lettered_once_each(letters: list, hostile: dict[int, str]) -> None:
    assert sorted(letter.source_offset for letter in letters) == sorted(hostile)
    for letter in letters:
        field = HOSTILE[hostile[letter.source_offset]][0]
        assert letter.reason.startswith(f"{field}: "), (hostile[letter.source_offset],
                                                        letter.reason)


async def test_hostile_groups_are_dead_lettered_and_never_end_the_run(kafka_broker, model_dir,
                                                                      tmp_path):
    run, out = unique_run(), tmp_path / "out"
    async with open_bus(kafka_broker.url) as bus:
        await bus.create_topics(run_topics(run, trajectory_partitions=1))
    good, hostile = await publish_interleaved(kafka_broker.bootstrap,
                                              topic_name(run, "trajectories"))
    steps = len(good) // PER_STEP
    settings = trainer_settings(kafka_broker.url, run, model_dir, out, groups_per_step=PER_STEP,
                                max_staleness=1000, checkpoint_every=0)
    settings.append(f"learner.max_tokens_per_micro_batch={BUDGET}")

    first = spawn("consumers.trainer", settings, tmp_path / "first.log")  # runs until killed
    try:
        await wait_until(lambda: len(ledger(out)) == steps, first, tmp_path / "first.log",
                         "training every good group")
        first_letters = await dead_letters(kafka_broker.url, run, len(hostile), timeout_s=30)
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
    finally:
        first.send_signal(signal.SIGKILL)  # no checkpoint: the next trainer reads it all again
        first.wait(timeout=30)
    assert_dead_lettered_once_each(first_letters, hostile)

    second = spawn("consumers.trainer", settings + [f"loop.max_steps={steps}"],
                   tmp_path / "second.log")
    wait_exit(second, tmp_path / "second.log", 180)
    letters = await dead_letters(kafka_broker.url, run, 2 * len(hostile) + 1, timeout_s=5)
    assert "started at step 0" in (tmp_path / "second.log").read_text()
    assert_dead_lettered_once_each(letters[len(first_letters):], hostile)

    entries = ledger(out)
    assert [e["step"] for e in entries] == list(range(1, steps + 1))
    trained = [g for e in entries for g in e["trained"]]
    assert sorted(trained) == good, "a good group was lost or trained twice"
    assert not any(g.startswith("h-") for e in entries for kind in ("trained", "dropped",
                                                                    "filtered") for g in e[kind])
    last = json.loads(Path(out / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["trainer/rejected_groups"] == len(hostile)
    assert last["trainer/dead_lettered"] == len(hostile)
    assert last["trainer/rejected/versions"] == 2 and last["trainer/rejected/rewards"] == 3
