"""A producer with an environment, end to end on both buses: calculator-tool episodes are
published as 1.4 episode groups that decode with the right masks, versions and turn ends; a
failing environment's episodes are counted (counters and heartbeat), dead-lettered with their
reason and sample (and counted by kind in `miles stats`), and never published; with no
environment the published samples carry no episode fields."""

from __future__ import annotations

import asyncio
import re
import time

import numpy as np
import pytest

from miles.envs import load_environment
from miles.episodes import EpisodeSettings
from miles.experience.stats import format_stats, stats
from miles.experience.tail import tail
from miles.protocol import DeadLetter, Heartbeat, PromptTask, TrajectoryGroup, decode, encode
from miles.protocol.topics import topic_name
from miles.rl.sampling import SamplingParams
from miles.rollout import RolloutConfig, RolloutWorker
from miles.tasks.rewards import resolve_reward
from miles.tasks.tiny_model import build_char_tokenizer
from tests.scripted import ScriptedEngine

PROBLEMS = {"m1": (12, 34), "m2": (56, 78), "m3": (9, 87)}
WAIT_S = 120.0


@pytest.fixture(scope="module")
def chat_tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("chat-tok")
    build_char_tokenizer(chat=True).save_pretrained(out)
    return out


def calculator_user(prompt: str) -> str:
    """A model that always calls the calculator on the prompt's product, then answers with
    the result it was given."""
    results = re.findall(r"<result>(.*?)</result>", prompt)
    if results:
        return results[-1]
    a, b = re.match(r"(\d+)\*(\d+)=", prompt).groups()
    return f"<tool>calculator: {a}*{b}</tool> and more"  # the stop string ends the turn


async def feed_tasks(bus, run, tasks: dict[str, dict]) -> None:
    for task_id, fields in tasks.items():
        await bus.publish(topic_name(run, "prompts"), encode(PromptTask(
            task_id=task_id, created_at=time.time(), **fields)), key=task_id.encode())


async def produce(bus, run, engine, *, env, groups: int, n: int = 2, **worker_kwargs):
    """Run a producer until `groups` groups are published (or WAIT_S); its groups and beats."""
    scorer = resolve_reward("exact_match")
    factory = load_environment(env, reward=scorer) if env else None
    worker = RolloutWorker(bus, engine, scorer, RolloutConfig(
        run=run, sampling=SamplingParams(n=n, max_new_tokens=40), prompts_per_batch=4,
        max_staleness=1000, heartbeat_s=0.1), env=factory, **worker_kwargs)
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run(stop))
    published, beats = [], []
    async with bus.consumer([topic_name(run, "trajectories")], group_id="audit") as audit, \
            bus.consumer([topic_name(run, "status")], group_id="audit-status") as status:
        deadline = time.monotonic() + WAIT_S
        while len(published) < groups and time.monotonic() < deadline:
            published += [decode(r.value, TrajectoryGroup) for r in await audit.poll(timeout_s=0.2)]
        # beats are read in order from the first: read on until one carries the groups counted
        # (a single later poll could still return beats from before the batch's counters)
        while (not beats or beats[-1].extra["groups"] < len(published)) \
                and time.monotonic() < deadline:
            beats += [b for b in (decode(r.value, Heartbeat) for r in
                                  await status.poll(timeout_s=0.2)) if b.role == "producer"]
    stop.set()
    await asyncio.wait_for(running, 60)
    return worker, published, beats


async def test_calculator_episodes_are_published_as_episode_groups(bus, run, chat_tokenizer_dir):
    engine = ScriptedEngine(chat_tokenizer_dir, calculator_user)
    await feed_tasks(bus, run, {k: {"prompt": f"{a}*{b}=", "reference": str(a * b)}
                                for k, (a, b) in PROBLEMS.items()})
    worker, published, beats = await produce(bus, run, engine, env="calculator", groups=3,
                                             episodes=EpisodeSettings(max_total_tokens=100))
    assert sorted(g.task_id for g in published) == sorted(PROBLEMS)
    assert all(stops == ("</tool>",) for _, stops in engine.calls)  # the env's stop string
    for group in published:
        a, b = PROBLEMS[group.task_id]
        assert group.prompt_token_ids.tolist() == engine.encode(f"{a}*{b}=")
        assert group.sampling["max_new_tokens"] == 100  # the limit on an episode's length
        assert len(group.samples) == 2
        for sample in group.samples:
            call = engine.encode(f"<tool>calculator: {a}*{b}</tool>")
            result = engine.encode(f"<result>{a * b}</result>")
            answer = engine.encode(str(a * b)) + [engine.eos_token_id]
            assert sample.response_token_ids.tolist() == call + result + answer
            mask = [1] * len(call) + [0] * len(result) + [1] * len(answer)
            assert sample.loss_mask.tolist() == mask
            assert sample.versions.tolist() == [0 if m else -1 for m in mask]
            assert sample.turn_ends.tolist() == [len(call) + len(result), len(mask)]
            assert (sample.logprobs[np.asarray(mask) == 0] == 0.0).all()
            assert sample.reward == 1.0 and sample.finish_reason == "stop"
            assert sample.token_rewards.tolist() == [0.0] * (len(mask) - 1) + [1.0]
            assert sample.episode["turns"] == 2 and sample.episode["tool_calls"] == 1
            assert sample.episode["tool_errors"] == 0
    counts = worker.counts
    assert counts["producer/episodes"] == 6 and counts["producer/turns"] == 12
    assert counts["producer/tool_calls"] == 6 and counts["producer/failed_episodes"] == 0
    extra = beats[-1].extra
    assert (extra["episodes"], extra["turns"], extra["tool_calls"]) == (6, 12, 6)
    # the producer's own time on episodes (decode, render, samples), total and per episode
    assert counts["producer/work_s"] > 0 and extra["work_s"] == round(counts["producer/work_s"], 3)
    assert extra["work_s_per_episode"] == round(counts["producer/work_s"] / 6, 4)
    assert extra["env_s_per_episode"] == round(counts["producer/env_s"] / 6, 4)
    assert counts["producer/tokens"] == sum(s.policy_tokens for g in published
                                            for s in g.samples)


async def test_failed_episodes_are_dead_lettered_counted_and_never_published(
        bus, run, chat_tokenizer_dir):
    engine = ScriptedEngine(chat_tokenizer_dir, lambda prompt: "ok")
    await feed_tasks(bus, run, {
        "crash": {"prompt": "1*1=", "metadata": {"fail_at": 2}},
        "fine": {"prompt": "2*2=", "metadata": {"turns": 2}}})
    worker, published, beats = await produce(bus, run, engine, env="tests.envs:Gated",
                                             groups=1)
    await asyncio.sleep(0)
    assert [g.task_id for g in published] == ["fine"]
    (fine,) = published
    assert all(s.error is None and s.loss_mask is not None for s in fine.samples)
    counts = worker.counts
    assert counts["producer/failed_episodes"] == 2 and counts["producer/failed/env_error"] == 2
    assert counts["producer/empty_groups"] == 1 and counts["producer/episodes"] == 4
    extra = beats[-1].extra
    assert extra["failed_episodes"] == 2 and extra["failed_env_error"] == 2

    letters = await read_letters(bus, run, count=2)
    assert len(letters) == counts["producer/failed_episodes"]
    assert len({key for key, _ in letters}) == 2  # one key per episode
    prompts = topic_name(run, "prompts")
    for _, letter in letters:
        assert letter.reason == ("episode failed: env_error: step raised RuntimeError: the "
                                 "simulator crashed"), letter.reason
        assert (letter.source_topic, letter.consumer) == (prompts, "producer-0")
        assert letter.consumer_group == f"miles.{run}.producers"
        group = decode(letter.payload, TrajectoryGroup)  # the episode, as it would have gone
        assert letter.payload_size == len(letter.payload)
        assert group.task_id == "crash" and len(group.samples) == 1
        assert group.prompt_token_ids.tolist() == engine.encode("1*1=")
        (sample,) = group.samples
        assert sample.finish_reason == "abort" and sample.episode["failed"] == "env_error"
        assert sample.error == letter.reason.removeprefix("episode failed: ")
        assert len(sample.turn_ends) == 2 and sample.episode["turns"] == 2  # crashed on 2
        assert sample.loss_mask.sum() == 2 * len(engine.encode("ok") + [engine.eos_token_id])
    summary = await stats(bus, run)
    assert summary["dlq"]["failed_episodes"] == {"records": 2, "kinds": {"env_error": 2}}
    assert summary["dlq"]["records"] == 0  # no record of the trajectories range was rejected
    assert "failed episodes   2 (env_error: 2) in the run's DLQ" in format_stats(summary)
    shown = [line async for line in tail(bus, run, "dlq", start="earliest", limit=2)]
    for line in shown:
        assert ": episode failed: env_error: step raised RuntimeError" in line, line
        assert " | group crash/e0/producer-0/" in line and " finish abort:1 " in line, line
        assert " turns [2] policy " in line, line


async def read_letters(bus, run, *, count: int) -> list[tuple[bytes, DeadLetter]]:
    """The run's dead letters (Kafka key, letter): `count` of them, then whatever else comes
    within a short wait."""
    letters = []
    async with bus.consumer([topic_name(run, "dlq")], group_id="audit-dlq") as audit:
        deadline = time.monotonic() + WAIT_S
        while len(letters) < count and time.monotonic() < deadline:
            letters += [(r.key, decode(r.value, DeadLetter))
                        for r in await audit.poll(timeout_s=0.2)]
        letters += [(r.key, decode(r.value, DeadLetter)) for r in await audit.poll(timeout_s=0.5)]
    return letters


async def test_without_an_environment_samples_are_single_turn(bus, run, chat_tokenizer_dir):
    engine = ScriptedEngine(chat_tokenizer_dir, lambda prompt: "42")
    await feed_tasks(bus, run, {"plain": {"prompt": "6*7=", "reference": "42"}})
    worker, (group,), beats = await produce(bus, run, engine, env="", groups=1)
    for sample in group.samples:
        assert (sample.loss_mask, sample.turn_ends, sample.episode) == (None, None, {})
        assert sample.reward == 1.0
    assert "producer/episodes" not in worker.counts and "episodes" not in beats[-1].extra
