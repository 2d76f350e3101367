"""Single-turn prompts the engine cannot take for what they ask, batched and streamed: a prompt
that fills the engine's context (checked before generating) or one the engine refuses
(`EngineRejectedError`: a vLLM server's 400, found row by row in a batch) is dead-lettered,
counted (`producer/rejected_prompts`, in the heartbeat) and committed past; the rest of its
batch goes on, and nothing is retried. A prompt near the context samples only the room left
(a vLLM server refuses prompt + max_tokens past max_model_len), and its group records that
limit. Engines: hf on a tiny model of 32 positions; vllm-server against the recorded-reply
server of tests/unit/test_vllm_server.py; in-process vLLM against the fake AsyncLLM of
tests/unit/test_vllm_engine.py."""

from __future__ import annotations

import asyncio

import time

import numpy as np
import pytest

from miles import rollout
from miles.bus import open_bus
from miles.engines import HFEngine
from miles.engines.vllm_server import VLLMServerEngine
from miles.protocol import DeadLetter, Heartbeat, PromptTask, TrajectoryGroup, decode, encode
from miles.protocol.topics import run_topics, topic_name
from miles.rl.sampling import SamplingParams
from miles.status import format_status, producer_status
from miles.rollout import RolloutConfig, RolloutWorker
from miles.tasks.rewards import Scorer
from tests.factories import tokenizer_folder
from tests.rewards import starts_with_digit
from tests.unit.test_vllm_server import VOCAB, FakeVLLM, recorded

POSITIONS = 32
SAMPLING = SamplingParams(n=2, temperature=1.0, max_new_tokens=8)
REFUSED = (400, recorded("error_context_length.json"))


@pytest.fixture(scope="module")
def short_engine(tmp_path_factory):
    from miles.tasks.tiny_model import build_tiny_model

    return HFEngine(build_tiny_model(tmp_path_factory.mktemp("short"), hidden_size=32, layers=1,
                                     heads=2, kv_heads=1, max_positions=POSITIONS))


def task(name: str, length: int) -> PromptTask:
    ids = np.asarray([6 + i % 10 for i in range(length)], dtype=np.int32)
    return PromptTask(task_id=name, prompt="", prompt_token_ids=ids, reference="5",
                      created_at=0.0)


async def produce(engine, tasks: list[PromptTask], run: str, **settings) -> dict:
    """Run a producer over `tasks` (one partition, in order) until each is published or
    rejected; what it published, dead-lettered and committed, and its last heartbeat."""
    async with open_bus("embedded://") as bus:
        await bus.create_topics(run_topics(run, prompt_partitions=1, trajectory_partitions=1))
        for t in tasks:
            await bus.publish(topic_name(run, "prompts"), encode(t))
        worker = RolloutWorker(bus, engine, Scorer(starts_with_digit), RolloutConfig(
            run=run, max_staleness=1000, heartbeat_s=60, **settings))
        stop = asyncio.Event()
        running = asyncio.create_task(worker.run(stop))
        try:
            deadline = asyncio.get_running_loop().time() + 30
            while (worker.counts["producer/groups"]
                   + worker.counts.get("producer/rejected_prompts", 0) < len(tasks)):
                assert not running.done(), running.result()
                assert asyncio.get_running_loop().time() < deadline, worker.counts
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)  # time to retry anything (nothing should be)
            await worker._heartbeat()
        finally:
            stop.set()
            await asyncio.wait_for(running, 30)
        out = {"counts": worker.counts, "worker": worker}
        for kind, cls in (("trajectories", TrajectoryGroup), ("dlq", DeadLetter),
                          ("status", Heartbeat)):
            async with bus.consumer([topic_name(run, kind)], group_id="audit") as audit:
                out[kind] = [decode(r.value, cls) for r in await audit.poll(timeout_s=1)]
        out["committed"] = sum((await bus.group_offsets([topic_name(run, "prompts")]))[
            f"miles.{run}.producers"].values())
    return out


def check_rejected(out: dict, rejected: dict[str, str], published: int, fed: int) -> None:
    """`rejected` (task id -> words of its letter's reason) dead-lettered once each, the others
    published, every prompt committed, nothing retried."""
    counts = out["counts"]
    assert counts["producer/rejected_prompts"] == len(rejected)
    assert counts["producer/engine_errors"] == 0 and counts["producer/groups"] == published
    assert out["committed"] == fed
    letters = {letter.source_offset: letter for letter in out["dlq"]}
    assert len(letters) == len(out["dlq"]) == len(rejected)
    for letter in letters.values():
        assert letter.reason.startswith("prompt rejected: ")
        assert decode(letter.payload, PromptTask).task_id in rejected
        assert rejected[decode(letter.payload, PromptTask).task_id] in letter.reason
    assert [b.extra["rejected_prompts"] for b in out["status"]][-1] == len(rejected)
    row = producer_status(out["status"], time.time(), stale_s=60)
    assert row["refused"] == {"rejected_prompts": len(rejected)}
    shown = format_status({"time": time.time(), "run": "r", "window_s": 60, "producers": [row],
                           "trainer": None, "consumer_lag": {}, "records": {},
                           "dlq_records": len(rejected), "invalid_heartbeats": 0})
    assert f"prompts dead-lettered: rejected_prompts {len(rejected)}" in shown


@pytest.mark.parametrize("max_in_flight", [0, 2])
async def test_hf_dead_letters_a_prompt_past_its_context_and_the_rest_goes_on(short_engine,
                                                                             max_in_flight):
    tasks = [task("short-0", 4), task("long", 40), task("near", POSITIONS - 4),
             task("fills", POSITIONS), task("short-1", 5)]
    out = await produce(short_engine, tasks, f"hf-context-{max_in_flight}", sampling=SAMPLING,
                        prompts_per_batch=8, max_in_flight=max_in_flight)
    check_rejected(out, {"long": "40 tokens fill engine hf's context of 32",
                         "fills": "32 tokens fill engine hf's context of 32"},
                   published=3, fed=len(tasks))
    groups = {g.task_id: g for g in out["trajectories"]}
    assert sorted(groups) == ["near", "short-0", "short-1"]
    for group in groups.values():
        room = min(SAMPLING.max_new_tokens, POSITIONS - len(group.prompt_token_ids))
        assert group.sampling["max_new_tokens"] == room
        assert all(len(s.response_token_ids) <= room for s in group.samples)
    assert groups["near"].sampling["max_new_tokens"] == 4


def server_engine(fake: FakeVLLM, tmp_path) -> VLLMServerEngine:
    return VLLMServerEngine(fake.url, "tiny", tokenizer_folder(tmp_path / "tok", vocab_size=VOCAB),
                            timeout_s=5.0, check_logprobs_mode=False)


def two_choices() -> dict:
    reply = recorded("completion_2x2.json")
    return {**reply, "choices": reply["choices"][:2]}


@pytest.mark.parametrize("max_in_flight", [0, 1])
async def test_a_prompt_the_server_refuses_is_dead_lettered_not_retried(tmp_path, monkeypatch,
                                                                        max_in_flight):
    """The server answers 400 (prompt plus max_tokens past its context, as vLLM words it):
    batched, the call of both prompts and then the second prompt's own call; streamed, the
    first prompt's call. The refused prompt is dead-lettered, the other published."""
    monkeypatch.setattr(rollout, "ENGINE_RETRY_S", 0.1)
    fake = FakeVLLM()
    replies = (REFUSED, two_choices(), REFUSED) if not max_in_flight else (REFUSED, two_choices())
    fake.route("POST", "/v1/completions", *replies)
    tasks = [task("a", 4), task("b", 4)]
    try:
        out = await produce(server_engine(fake, tmp_path), tasks, f"server-{max_in_flight}",
                            sampling=SamplingParams(n=2, max_new_tokens=3), prompts_per_batch=2,
                            max_in_flight=max_in_flight, weight_update="finish")
    finally:
        fake.close()
    refused = "b" if not max_in_flight else "a"
    check_rejected(out, {refused: "maximum context length is 64"}, published=1, fed=2)
    assert [g.task_id for g in out["trajectories"]] == [{"a": "b", "b": "a"}[refused]]
    sent = [len(body["prompt"]) for body in fake.posted("/v1/completions")]
    assert sent == ([2, 1, 1] if not max_in_flight else [1, 1])


@pytest.mark.parametrize("max_in_flight", [0, 1])
async def test_the_server_is_asked_for_the_room_left_and_never_past_its_context(
        tmp_path, max_in_flight):
    """models.json's max_model_len is 64: a prompt of 62 tokens asks for 2 tokens, not 3 (vLLM
    would answer 400); one of 64 is never sent."""
    fake = FakeVLLM()
    fake.route("POST", "/v1/completions", two_choices())
    tasks = [task("fills", 64), task("near", 62)]
    try:
        out = await produce(server_engine(fake, tmp_path), tasks, f"room-{max_in_flight}",
                            sampling=SamplingParams(n=2, max_new_tokens=3),
                            prompts_per_batch=2, max_in_flight=max_in_flight,
                            weight_update="finish")
    finally:
        fake.close()
    check_rejected(out, {"fills": "64 tokens fill engine vllm-server's context of 64"},
                   published=1, fed=2)
    assert [(len(b["prompt"][0]), b["max_tokens"]) for b in fake.posted("/v1/completions")] == [
        (62, 2)]
    assert out["trajectories"][0].sampling["max_new_tokens"] == 2


async def test_a_request_in_process_vllm_refuses_is_dead_lettered(tmp_path, monkeypatch):
    """engine=vllm streams requests (the fake AsyncLLM): a request vLLM refuses (its request
    errors, e.g. a prompt past max_model_len) is dead-lettered, the next group goes on."""
    from miles.engines import vllm_engine
    from tests.unit.test_vllm_engine import FAKE_VLLM

    monkeypatch.setattr(rollout, "ENGINE_RETRY_S", 0.1)
    monkeypatch.setattr(vllm_engine, "import_vllm", lambda: FAKE_VLLM)
    engine = vllm_engine.VLLMEngine(tokenizer_folder(tmp_path / "tok", vocab_size=VOCAB),
                                    vllm_engine.VLLMEngineSettings(timeout_s=5.0), lora=None)
    engine._llm.fail["generate"] = ValueError("the prompt is too long for max_model_len")
    try:
        out = await produce(engine, [task("a", 4), task("b", 4)], "vllm-refused",
                            sampling=SamplingParams(n=2, max_new_tokens=3), max_in_flight=1,
                            weight_update="finish")
    finally:
        engine.close()
    check_rejected(out, {"a": "too long for max_model_len"}, published=1, fed=2)
    assert [g.task_id for g in out["trajectories"]] == ["b"]
