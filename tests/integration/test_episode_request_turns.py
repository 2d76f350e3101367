"""`episodes.stream_turns` on the vLLM engines (`RequestTurns`): each turn is its own engine
call, made the moment its episode asks, concurrent with the others, so turns are generated
while other episodes' tools run; a call the engine refuses fails only its episode. The engine
here is scripted (the real vLLM runs in tests/vllm/test_episodes.py) and slow, so overlaps
show in time."""

from __future__ import annotations

import threading
import time

import pytest

from miles.episodes import EpisodeSettings
from miles.episodes.turn_streams import RequestTurns, turn_stream
from miles.errors import ConfigError, EngineRejectedError
from miles.protocol import PromptTask
from miles.rl.sampling import SamplingParams
from tests import envs
from tests.integration.test_episodes import run_episodes
from tests.scripted import ScriptedEngine

SAMPLING = SamplingParams(n=2, temperature=1.0, max_new_tokens=8)
CALL_S = 0.1


class SlowServer(ScriptedEngine):
    """A scripted engine named like the vLLM server: each call takes CALL_S and is timed."""

    name = "vllm-server"

    def __init__(self, tokenizer_dir, refuse: str = ""):
        super().__init__(tokenizer_dir, lambda text: "ok.")
        self.intervals: list[tuple[float, float, int]] = []
        self.refuse, self.lock = refuse, threading.Lock()

    def generate(self, prompts, params, *, seed=None, stop_strings=()):
        began = time.monotonic()
        if self.refuse and self.refuse in self.decode(prompts[0]):
            raise EngineRejectedError("prompt too long for the server")
        time.sleep(CALL_S)
        result = super().generate(prompts, params, seed=seed, stop_strings=stop_strings)
        with self.lock:
            self.intervals.append((began, time.monotonic(), len(prompts)))
        return result


def tasks(count: int, **metadata) -> list[PromptTask]:
    return [PromptTask(task_id=f"t{i}", prompt=f"{i}+{i}=", created_at=0.0,
                       metadata={"name": f"t{i}", **metadata}) for i in range(count)]


def overlapping(intervals) -> int:
    """Pairs of calls that ran at the same time."""
    return sum(a[0] < b[1] and b[0] < a[1] for i, a in enumerate(intervals)
               for b in intervals[i + 1:])


def test_the_vllm_engines_stream_turns_as_concurrent_calls(model_dir):
    engine = SlowServer(model_dir)
    assert isinstance(turn_stream(engine, None), RequestTurns)
    EpisodeSettings(stream_turns=True).check_engine("vllm")
    EpisodeSettings(stream_turns=True).check_engine("vllm-server")
    with pytest.raises(ConfigError, match="stream_turns"):
        EpisodeSettings(stream_turns=True).check_engine("scripted")


async def test_turns_are_generated_while_other_episodes_tools_run(model_dir):
    engine = SlowServer(model_dir)
    settings = EpisodeSettings(stream_turns=True)
    prompts = tasks(2, delay=0.3)  # each environment step (a tool) takes 0.3 s
    records, _ = await run_episodes(engine, envs.Gated, prompts, settings=settings,
                                    sampling=SAMPLING)
    assert all(r.failure is None and len(r.turns) == 3 for g in records for r in g)
    calls = engine.intervals  # 2 prompts x 2 episodes x 3 turns, one call each
    assert [rows for *_, rows in calls] == [1] * 12
    assert overlapping(calls) >= 4  # the calls ran concurrently, not one after another


async def test_a_refused_turn_fails_its_episode_only(model_dir):
    engine = SlowServer(model_dir, refuse="1+1")
    records, _ = await run_episodes(engine, envs.Counter, tasks(2),
                                    settings=EpisodeSettings(stream_turns=True),
                                    sampling=SAMPLING)
    assert all(r.failure is None and len(r.turns) == 3 for r in records[0])
    assert all(r.failure_kind == "engine_rejected" for r in records[1])
