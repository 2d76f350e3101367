"""Producer overhead of multi-turn episodes: where an episode's time goes, and how busy the engine
is while tools run, across `episodes.max_concurrent` and the two schedules (rounds, and turns
streamed through the engine's continuous batcher: `episodes.stream_turns`).

    PYTHONPATH=$PWD python3 benchmarks/bench_episodes.py [--envs sleep0,sleep20,sleep100,\
calculator,python] [--concurrency 0,8] [--modes rounds,stream] [--prompts 8] [--n 2] \
        [--tool-turns 2] [--max-new-tokens 16] [--repeats 2] [--out runs/bench-episodes]

It drives the producer's own `EpisodeGroups` (the `EpisodeRunner`, samples and counters) with
the HF engine on the tiny chat model, the engine in one executor thread as in the producer.
An untrained model never writes a tool call, so each environment is a real tool environment
whose first `tool-turns` actions are replaced by a scripted call (the model's tokens are still
generated, kept and rendered; only the text the tools see is scripted); the last turn is the
model's own answer, scored. Environments: `sleepMS` (an async tool that sleeps MS
milliseconds), `calculator` (the built-in one), `python` (the built-in sandbox: a child
process per call). Per configuration, the median over `repeats` of: wall time of the batch,
engine time (inside the engine thread's generate calls, or decoding steps when streamed) and
its share of the wall time (the engine's busy fraction), engine calls and rows per call (when
streamed: tokens per step), and per episode: environment time
(`env_s`: reset, steps, close), the producer's own work (`work_s`: decoding, rendering
observations, building the sample) and the engine's time amortised over the episodes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from miles.engines.hf import HFEngine
from miles.envs import Action, Environment, PythonEnv, Step, Task, ToolEnvironment, tool
from miles.envs.builtin import CalculatorEnv
from miles.episodes import EpisodeSettings
from miles.protocol import PromptTask
from miles.rl.sampling import SamplingParams
from miles.rollout_groups import EpisodeGroups
from miles.tasks.rewards import resolve_reward
from miles.tasks.tiny_model import build_tiny_model

MODEL = {"hidden_size": 128, "layers": 4, "heads": 4, "kv_heads": 2}  # the demo's tiny model
MAX_POSITIONS = 512
CALLS = {"calculator": "<tool>calculator: 12*34</tool>",
         "python": '<tool_call>{"name": "python", "arguments": {"code": "print(12*34)"}}'
                   '</tool_call>'}


async def wait(ms: str) -> str:
    """Sleep `ms` milliseconds (a tool of controlled latency)."""
    await asyncio.sleep(float(ms) / 1000)
    return "done"


class SleepEnv(ToolEnvironment):
    tool_style = "text"
    tools = (tool(wait),)


class Scripted(Environment):
    """`inner`, its first `tool_turns` actions replaced by `call` (see the module docstring)."""

    def __init__(self, inner: ToolEnvironment, call: str, tool_turns: int):
        self.inner, self.call, self.tool_turns = inner, call, tool_turns
        self.stop_strings = inner.stop_strings
        self.steps = 0

    async def reset(self, task: Task):
        return await self.inner.reset(task)

    async def step(self, action: Action) -> Step:
        self.steps += 1
        if self.steps <= self.tool_turns:
            action = Action(self.call, action.token_ids, action.finish_reason)
        return await self.inner.step(action)

    async def close(self) -> None:
        await self.inner.close()


def factory(name: str, tool_turns: int):
    reward = resolve_reward("exact_match")
    if name.startswith("sleep"):
        call = f"<tool>wait: {int(name.removeprefix('sleep'))}</tool>"
        return lambda: Scripted(SleepEnv(reward=reward), call, tool_turns)
    inner = {"calculator": CalculatorEnv, "python": PythonEnv}[name]
    return lambda: Scripted(inner(reward=reward), CALLS[name], tool_turns)


class TimedEngineThread:
    """The producer's `in_engine` (one executor thread), timing the calls inside the thread."""

    def __init__(self):
        self.executor = ThreadPoolExecutor(1)
        self.inside_s, self.calls, self.rows = 0.0, 0, 0

    async def __call__(self, fn, *args, **kwargs):
        def timed():
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.inside_s += time.perf_counter() - began

        self.calls += 1
        self.rows += len(args[0]) if args and isinstance(args[0], list) else 0
        return await asyncio.get_running_loop().run_in_executor(self.executor, timed)


async def measure(engine, env: str, concurrency: int, mode: str, args) -> dict:
    sampling = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens)
    settings = EpisodeSettings(max_turns=args.tool_turns + 1, max_total_tokens=384,
                               max_observation_tokens=128, max_concurrent=concurrency,
                               stream_turns=mode == "stream")
    sampler = engine.streaming_sampler()
    tasks = [PromptTask(task_id=f"t{i}", prompt=f"{10 + i}*{20 + i}=",
                        reference=str((10 + i) * (20 + i)), created_at=0.0)
             for i in range(args.prompts)]
    batch = [(task, engine.encode(task.prompt)) for task in tasks]
    runs = []
    for repeat in range(args.repeats):
        thread, counts = TimedEngineThread(), {}
        groups = EpisodeGroups(engine, sampling, "bench", counts,
                               factory=factory(env, args.tool_turns), settings=settings,
                               in_engine=thread)
        began, tokens = time.perf_counter(), sampler.tokens_generated
        await groups.groups(batch, seed=repeat, sequence=repeat)
        wall = time.perf_counter() - began
        thread.executor.shutdown()
        episodes = counts["producer/episodes"]
        rows = thread.rows if mode == "rounds" else sampler.tokens_generated - tokens
        runs.append({"wall_s": wall, "engine_s": thread.inside_s, "calls": thread.calls,
                     "rows_per_call": rows / thread.calls,
                     "episodes": episodes, "turns_per_episode": counts["producer/turns"] / episodes,
                     "failed": counts["producer/failed_episodes"],
                     "env_s_per_episode": counts["producer/env_s"] / episodes,
                     "work_s_per_episode": counts["producer/work_s"] / episodes,
                     "engine_s_per_episode": thread.inside_s / episodes,
                     "busy": thread.inside_s / wall})
    row = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    return {"env": env, "mode": mode, "max_concurrent": concurrency,
            **{k: round(v, 4) for k, v in row.items()}}


def table(rows: list[dict]) -> str:
    head = ("| env | mode | max_concurrent | wall s | engine s | engine busy | calls | rows/call | "
            "turns/ep | env ms/ep | work ms/ep | engine ms/ep |")
    lines = [head, "|" + " --- |" * 12]
    for r in rows:
        lines.append(
            f"| {r['env']} | {r['mode']} | {r['max_concurrent'] or 'all'} | {r['wall_s']:.2f} | "
            f"{r['engine_s']:.2f} | {r['busy']:.0%} | {r['calls']:.0f} | {r['rows_per_call']:.1f} | "
            f"{r['turns_per_episode']:.1f} | {1000 * r['env_s_per_episode']:.1f} | "
            f"{1000 * r['work_s_per_episode']:.2f} | {1000 * r['engine_s_per_episode']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", default="sleep0,sleep20,sleep100,calculator,python")
    parser.add_argument("--concurrency", default="0,8")
    parser.add_argument("--modes", default="rounds,stream")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--tool-turns", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("runs/bench-episodes"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = args.out / "model"
    if not (model_dir / "config.json").exists():
        build_tiny_model(model_dir, max_positions=MAX_POSITIONS, chat=True, **MODEL)
    engine = HFEngine(model_dir)
    engine.generate([engine.encode("1+1=")], SamplingParams(max_new_tokens=4))  # warm-up
    rows = []
    for env in args.envs.split(","):
        for mode in args.modes.split(","):
            for concurrency in (int(c) for c in args.concurrency.split(",")):
                rows.append(asyncio.run(measure(engine, env, concurrency, mode, args)))
                print(json.dumps(rows[-1]), flush=True)
    (args.out / "episodes.json").write_text(json.dumps(rows, indent=2))
    print(table(rows))


if __name__ == "__main__":
    main()
