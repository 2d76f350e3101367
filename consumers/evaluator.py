"""Evaluator daemon: `python -m consumers.evaluator --config evaluator.yaml` (`miles evaluate`).

A fan-out consumer of a live run, reading in consumer groups of its own, so it never takes
records from the trainer and the trainer never waits for it:
- the trajectories stream, from where it is when the evaluator starts: per policy version (the
  group's oldest token), groups, samples and mean reward of what the producers publish;
- held-out accuracy: each newer announced weight version, at most every `every_s` seconds, is
  loaded (from `weights.store`, sha256-verified) and its greedy accuracy measured on
  `eval_problems` problems of the held-out split (`miles.evaluation.Evaluator`); with `env`,
  each problem is a greedy episode through that environment, solved when its return is
  positive, in the run's environment with its `tools` and `sandbox` limits.
Every `every_s` seconds it appends a `{"kind": "stream", ...}` line with the stream's numbers to
`out`, and a `{"kind": "held_out", ...}` line per measurement (also sent to the experiment
trackers as `held_out/accuracy`, `miles.trackers`). Invalid trajectory records
(tombstones included) are counted, not dead-lettered (the trainer does that); invalid control and
status records are dead-lettered under the evaluator's own groups, and commands, which it does
not read, are skipped. Stops on SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from miles.bus.security import KafkaSecurity
from miles.engines.base import LoraSettings
from miles.envs import SandboxLimits, ToolSettings, load_environment
from miles.episodes import EpisodeSettings
from miles.errors import MilesError
from miles.protocol import TrajectoryGroup, decode
from miles.service import daemon_main, wait_or_stop
from miles.trackers import TrackerSettings
from miles.weights.following import FollowConfig

if TYPE_CHECKING:
    from miles.evaluation import EpisodeEval


@dataclass(frozen=True, kw_only=True)
class EvaluatorSettings:
    bus: str = "kafka://127.0.0.1:9092"  # kafka://HOST:PORT
    kafka: KafkaSecurity = field(default_factory=KafkaSecurity)  # TLS/SASL (MILES_KAFKA__*)
    run: str = "demo"  # the run to follow: topics miles.<run>.*
    model_dir: Path = Path("model")  # the run's base model (from_pretrained)
    lora: LoraSettings | None = field(default_factory=LoraSettings)  # None: full weights
    prompts: str = "arithmetic"  # held-out problems: a built-in task's test split or a JSONL
    eval_problems: int = 500  # held-out problems per measurement
    every_s: float = 10.0  # period of stream lines and the most frequent held-out measurement
    reward: str = "exact_match"  # the run's reward (miles.tasks.rewards)
    reward_timeout_s: float = 10.0  # per reward call
    out: Path = Path("runs/evaluation.jsonl")  # JSON lines appended here
    torch_threads: int = 1  # the evaluator should not compete with the trainer for cores
    weights: FollowConfig = field(default_factory=FollowConfig)  # weight store and trainer key
    env: str = ""  # the run's environment: held-out problems as greedy episodes ("": one answer)
    episodes: EpisodeSettings = field(default_factory=EpisodeSettings)  # the run's limits
    turn_tokens: int = 8  # tokens per model turn with env (the producer's sampling.max_new_tokens)
    trackers: TrackerSettings = field(default_factory=TrackerSettings)  # TensorBoard, W&B, MLflow
    tools: ToolSettings = field(default_factory=ToolSettings)  # a tool environment's limits
    sandbox: SandboxLimits = field(default_factory=SandboxLimits)  # the python env's sandbox


class StreamStats:
    """Running per-version numbers of the trajectories stream."""

    def __init__(self):
        self.by_version: dict[int, list[float]] = defaultdict(lambda: [0, 0, 0.0])
        self.invalid = 0

    def add(self, value: bytes) -> None:
        try:
            group = decode(value, TrajectoryGroup)
        except MilesError:
            self.invalid += 1
            return
        entry = self.by_version[group.min_version]
        entry[0] += 1
        entry[1] += len(group.samples)
        entry[2] += sum(s.reward for s in group.samples)

    def line(self) -> dict:
        versions = {str(v): {"groups": g, "samples": n, "reward_mean": round(r / max(n, 1), 4)}
                    for v, (g, n, r) in sorted(self.by_version.items())}
        return {"kind": "stream", "time": time.time(), "invalid": self.invalid,
                "by_version": versions}


def append(path: Path, lines: list[dict]) -> None:
    with open(path, "a") as f:
        f.write("".join(json.dumps(line) + "\n" for line in lines))


async def run_evaluator(settings: EvaluatorSettings, stop: asyncio.Event) -> dict:
    import torch

    from miles.bus import open_bus
    from miles.evaluation import Evaluator
    from miles.tasks.datasets import load_problems
    from miles.tasks.rewards import resolve_reward
    from miles.trackers import open_trackers

    torch.set_num_threads(settings.torch_threads)
    scorer = resolve_reward(settings.reward, timeout_s=settings.reward_timeout_s)
    problems = load_problems(settings.prompts, "test")[:settings.eval_problems]
    episodes = episode_eval(settings, scorer)
    settings.out.parent.mkdir(parents=True, exist_ok=True)
    with open_trackers(settings.trackers, role="fanout-evaluator", run=settings.run,
                       default_dir=settings.out.parent / "trackers", config=settings) as trackers:
        async with open_bus(settings.bus, settings.kafka) as bus:
            evaluator = Evaluator(bus, settings.run, settings.model_dir, settings.lora,
                                  problems, every_s=settings.every_s, scorer=scorer,
                                  group="fanout-evaluator", weights=settings.weights,
                                  episodes=episodes, trackers=trackers)
            return await _evaluate(settings, bus, evaluator, stop)


async def _evaluate(settings: EvaluatorSettings, bus, evaluator, stop: asyncio.Event) -> dict:
    """Read the trajectories stream, measure newer versions and report, until `stop`."""
    from miles.protocol.topics import topic_name

    stats = StreamStats()
    stream = bus.consumer([topic_name(settings.run, "trajectories")], from_beginning=False,
                          group_id=f"miles.{settings.run}.fanout-evaluator.trajectories")
    async with stream, evaluator:
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(_read_stream(stream, stats, stop))
            tasks.create_task(_report(settings, stats, evaluator, stop))
            tasks.create_task(evaluator.follow(stop, time.monotonic()))
    return {"measurements": len(evaluator.curve.points), "invalid": stats.invalid}


def episode_eval(settings: EvaluatorSettings, scorer) -> EpisodeEval | None:
    """The held-out episodes in the run's environment, built as the producers build it (its
    tool and sandbox limits too, so a problem is solved under the same limits as in training);
    None without `env`."""
    from miles.evaluation import EpisodeEval

    if not settings.env:
        return None
    factory = load_environment(settings.env, reward=scorer, tools=settings.tools,
                               sandbox=settings.sandbox)
    return EpisodeEval(factory=factory, settings=settings.episodes,
                       turn_tokens=settings.turn_tokens)


async def _read_stream(stream, stats: StreamStats, stop: asyncio.Event) -> None:
    while not stop.is_set():
        for record in await stream.poll(timeout_s=0.5):
            stats.add(record.value)


async def _report(settings: EvaluatorSettings, stats: StreamStats, evaluator,
                  stop: asyncio.Event) -> None:
    written = 0
    while not await wait_or_stop(stop, settings.every_s):
        points = evaluator.curve.points[written:]
        append(settings.out, [stats.line()] + [{"kind": "held_out", "time": time.time(), **point}
                                               for point in points])
        written += len(points)


def main(argv=None) -> int:
    return daemon_main(EvaluatorSettings, argv, prog="consumers.evaluator", doc=__doc__,
                       run=run_evaluator)


if __name__ == "__main__":
    raise SystemExit(main())
