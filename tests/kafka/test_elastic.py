"""Elastic producers on the real broker: two producer processes share the prompts, one is
killed with SIGKILL mid-run, and every prompt's group still reaches the trainer. Both with
batches and streaming (`max_in_flight`: groups end out of order, and each partition's commit
stays at its lowest prompt in flight, so a kill loses none)."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections import Counter

import pytest

from miles.bus import open_bus
from miles.feeder import feed
from miles.protocol import TrajectoryGroup, decode
from miles.protocol.topics import run_topics, topic_name
from miles.tasks.arithmetic import arithmetic_problems
from tests.conftest import unique_run
from tests.accounting import ledger
from tests.kafka.test_rl_processes import spawn, trainer_settings

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
PROMPTS = 160


MODES = {"batch": ["rollout.prompts_per_batch=2", "rollout.sampling.max_new_tokens=3"],
         "stream": ["rollout.max_in_flight=4", "rollout.sampling.max_new_tokens=48",
                    "rollout.sampling.temperature=1.0"]}


def producer(bus: str, run: str, model_dir, name: str, log, store, mode: str = "batch"):
    return spawn("producers.rollout", [
        f"bus={bus}", f"model_dir={model_dir}", "reward=tests.rewards:starts_with_digit",
        f"rollout.run={run}", f"rollout.producer_id={name}", *MODES[mode],
        "rollout.groups_per_step=4", "rollout.max_staleness=1000", "rollout.sampling.n=2",
        "rollout.heartbeat_s=0.5", f"rollout.weights.store={store}"], log)


def trained(out) -> list[str]:
    return [g for entry in ledger(out) for g in entry["trained"]]


@pytest.mark.parametrize("mode", ["batch", "stream"])
async def test_a_killed_producer_s_prompts_reach_the_trainer(kafka_broker, model_dir, tmp_path,
                                                             mode):
    run = unique_run()
    async with open_bus(kafka_broker.url) as bus:
        await bus.create_topics(run_topics(run, prompt_partitions=4, trajectory_partitions=2))
        await feed(bus, run, arithmetic_problems("train")[:PROMPTS])
        out = tmp_path / "out"
        trainer = spawn("consumers.trainer", trainer_settings(
            kafka_broker.url, run, model_dir, out, groups_per_step=1, max_staleness=1000,
            checkpoint_every=0), tmp_path / "trainer.log")
        a = producer(kafka_broker.url, run, model_dir, "producer-a", tmp_path / "a.log",
                     out / "weights", mode)
        b = producer(kafka_broker.url, run, model_dir, "producer-b", tmp_path / "b.log",
                     out / "weights", mode)
        groups: list[TrajectoryGroup] = []
        try:
            async with bus.consumer([topic_name(run, "trajectories")], group_id="audit") as audit:
                async def read(until, timeout_s: float) -> None:
                    deadline = time.monotonic() + timeout_s
                    while not until() and time.monotonic() < deadline:
                        groups.extend(decode(r.value, TrajectoryGroup)
                                      for r in await audit.poll(timeout_s=0.5))

                await read(lambda: Counter(g.producer_id for g in groups)["producer-a"] >= 6, 120)
                a.send_signal(signal.SIGKILL)
                a.wait(timeout=30)
                killed_after = len(groups)
                await read(lambda: len({g.task_id for g in groups}) == PROMPTS, 180)
                seen = -1
                while seen != len(groups):  # re-generated groups may still be on their way
                    seen = len(groups)
                    await read(lambda: False, 3.0)
            deadline = time.monotonic() + 60
            while len(trained(out)) < len(groups) and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
        finally:
            for process in (b, trainer):
                process.send_signal(signal.SIGTERM)
            for process in (b, trainer):
                process.wait(timeout=60)
    assert killed_after < PROMPTS, "producer-a was killed after the work was done"
    by_producer = Counter(g.producer_id for g in groups)
    assert by_producer["producer-a"] >= 6 and by_producer["producer-b"] > 0
    fed = {problem.task_id for problem in arithmetic_problems("train")[:PROMPTS]}
    assert {g.task_id for g in groups} == fed
    assert sorted(trained(out)) == sorted(g.group_id for g in groups), \
        (tmp_path / "trainer.log").read_text()[-2000:]
    regenerated = sum(n - 1 for n in Counter(g.task_id for g in groups).values())
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1].get("trainer/regenerated_groups", 0) == regenerated
    print(f"killed producer-a after {killed_after} groups; {regenerated} regenerated")
