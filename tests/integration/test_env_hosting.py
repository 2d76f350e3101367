"""Environments on threads of their own (`miles.episodes.hosting`): a step that blocks (time.sleep)
times out alone while the other episodes finish and the producer's loop keeps running; its
thread is abandoned, counted, closes the environment when the call returns, and is bounded."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from miles.engines import HFEngine
from miles.episodes import EpisodeRunner, EpisodeSettings, hosting
from miles.protocol import PromptTask
from miles.rl.sampling import SamplingParams
from tests import envs

SAMPLING = SamplingParams(n=2, temperature=1.0, max_new_tokens=4)
TIMEOUT = EpisodeSettings(env_step_timeout_s=0.3)
SLEEP_S = 3.0
TICK_S = 0.02
WAIT_S = 60.0


@pytest.fixture(scope="module")
def engine(model_dir):
    engine = HFEngine(model_dir)
    engine.generate([[5, 6]], SAMPLING)  # lazy initialisation is not what these tests time
    return engine


@pytest.fixture(autouse=True)
def fresh_counters():
    envs.Counter.seen, envs.Counter.closed = [], 0


def prompt_task(name: str, **metadata) -> PromptTask:
    return PromptTask(task_id=name, prompt="2+3=", reference="5",
                      metadata={"name": name, **metadata}, created_at=0.0)


async def run_episodes(engine, factory, tasks, settings=TIMEOUT):
    async def generate(prompts, params, **kwargs):
        return await asyncio.to_thread(engine.generate, prompts, params, **kwargs)

    runner = EpisodeRunner(engine, factory, settings, SAMPLING, generate_in_engine=generate)
    prompts = [(t, engine.encode(t.prompt)) for t in tasks]
    return await asyncio.wait_for(runner.run(prompts, seed=0), WAIT_S)


async def until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


async def test_a_blocking_step_times_out_alone_and_the_loop_keeps_running(engine):
    ticks = []

    async def ticker():
        while True:
            ticks.append(time.monotonic())
            await asyncio.sleep(TICK_S)

    ticking = asyncio.create_task(ticker())
    began = time.monotonic()
    records = await run_episodes(engine, envs.Sleepy, [prompt_task("slow", sleep=SLEEP_S),
                                                       prompt_task("fast")])
    took = time.monotonic() - began
    ticking.cancel()
    slow, fast = records
    assert all(r.failure_kind == "env_timeout" and "step took more than 0.3 s" in r.failure
               for r in slow)
    assert all(r.failure is None and len(r.turns) == 3 for r in fast)
    # nobody waited for the sleeping steps: their threads still sleep, unclosed
    assert hosting.abandoned_threads() == 2 and envs.Counter.closed == 2, took
    gap = np.diff(ticks).max()  # blocked, the loop would miss its ticks for SLEEP_S
    assert gap < SLEEP_S / 4, (gap, took)
    await until(lambda: hosting.abandoned_threads() == 0, "the abandoned threads end")
    assert envs.Counter.closed == 4  # each closed its environment once its sleep returned


async def test_beyond_the_bound_new_episodes_fail_instead_of_starting_threads(engine,
                                                                              monkeypatch):
    monkeypatch.setattr(hosting, "_abandoned", hosting.MAX_ABANDONED_THREADS)
    (records,) = await run_episodes(engine, envs.Counter, [prompt_task("a")])
    assert all(r.failure_kind == "env_stuck" and not r.turns for r in records)
    assert "environment threads are still running past their timeout" in records[0].failure


async def test_a_synchronous_step_runs_on_its_thread(engine):
    class SyncCounter(envs.Counter):
        def step(self, action):  # a plain method: its result is not awaited
            self.k += 1
            return envs.Step(None, 1.0, done=True) if self.k == 2 else envs.Step(f"n={self.k}.")

    (records,) = await run_episodes(engine, SyncCounter, [prompt_task("a")])
    assert all(r.failure is None and len(r.turns) == 2 for r in records)


async def test_the_cost_of_a_thread_per_episode_is_small():
    """Well-behaved async environments pay one thread per episode and a hop per call; both
    are measured here against the producer's loop (LoopHost) and bounded loosely."""
    async def step():
        return 1

    calls = 200
    began = time.perf_counter()
    host = hosting.LoopHost()
    for _ in range(calls):
        await host.call(step, timeout_s=1.0)
    on_loop = (time.perf_counter() - began) / calls
    began = time.perf_counter()
    host = hosting.ThreadHost("cost")
    for _ in range(calls):
        await host.call(step, timeout_s=1.0)
    host.release(None, 1.0)
    threaded = (time.perf_counter() - began) / calls
    began = time.perf_counter()
    for i in range(50):
        hosting.ThreadHost(f"start-{i}").release(None, 1.0)
    start = (time.perf_counter() - began) / 50
    print(f"per call: loop {on_loop * 1e6:.0f} us, thread {threaded * 1e6:.0f} us; "
          f"per episode (thread + loop start and stop): {start * 1e6:.0f} us")
    assert threaded < 0.005 and start < 0.01
