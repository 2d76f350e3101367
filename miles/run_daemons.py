"""A run's daemons on Kafka (`miles run`, `miles demo`): their settings, written as each reads
them, and the processes, which die with the process that started them.

Each daemon gets the run's `kafka` section (TLS/SASL, or `MILES_KAFKA__*`), so every process of
a run connects as the same user (a deployment gives each role its own, docs/security.md); the
password stays in the environment or its file.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from consumers.trainer import TrainerSettings
from miles.config import write_settings
from miles.demo_report import producers_episodes
from miles.errors import MilesError
from miles.run_watch import RunWatch
from miles.service import die_with_parent
from producers.rollout import ProducerSettings

if TYPE_CHECKING:
    from miles.evaluation import Evaluator
    from miles.run import RunConfig

log = logging.getLogger(__name__)


def producer_settings(config: RunConfig, model_dir: Path, index: int = 0) -> ProducerSettings:
    return ProducerSettings(bus=config.bus, kafka=config.kafka, model_dir=model_dir,
                            lora=config.lora, reward=config.reward,
                            torch_threads=config.role_threads(),
                            reward_timeout_s=config.reward_timeout_s, engine=config.engine,
                            vllm=config.vllm, vllm_server=config.vllm_server,
                            rollout=config.rollout(index), env=config.env,
                            episodes=config.episodes, tools=config.tools, sandbox=config.sandbox,
                            trackers=config.tracker_settings())


def daemon_settings(config: RunConfig, model_dir: Path) -> dict:
    """The daemons' settings for this run, by name: producer-0..N-1, trainer, evaluator,
    recorder."""
    from consumers.evaluator import EvaluatorSettings
    from consumers.recorder import RecorderSettings

    common = {"bus": config.bus, "kafka": config.kafka, "model_dir": model_dir,
              "lora": config.lora}
    producers = {f"producer-{i}": producer_settings(config, model_dir, i)
                 for i in range(config.producers)}
    return {
        **producers,
        "trainer": TrainerSettings(**common, torch_threads=config.role_threads(),
                                   learner=config.learner,
                                   loop=config.loop(), trackers=config.tracker_settings()),
        "evaluator": EvaluatorSettings(**common, run=config.run, prompts=config.prompts,
                                       reward=config.reward, every_s=config.eval_every_s,
                                       out=config.out_dir / "evaluation.jsonl",
                                       weights=config.weights(), env=config.env,
                                       episodes=config.episodes,
                                       turn_tokens=config.sampling.max_new_tokens,
                                       tools=config.tools, sandbox=config.sandbox,
                                       trackers=config.tracker_settings()),
        "recorder": RecorderSettings(bus=config.bus, kafka=config.kafka, run=config.run,
                                     out_dir=config.out_dir / "archive", file_seconds=30.0),
    }


def command(module: str, settings: Path, ranks: int = 1) -> list[str]:
    """The daemon's command line; the trainer under torchrun for several ranks."""
    if ranks > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={ranks}", "-m", module, "--config", str(settings)]
    return [sys.executable, "-m", module, "--config", str(settings)]


def start_daemons(config: RunConfig, model_dir: Path) -> dict[str, subprocess.Popen]:
    all_settings = daemon_settings(config, model_dir)
    names = ["trainer", *(f"producer-{i}" for i in range(config.producers))]
    if config.fanout:
        names += ["evaluator", "recorder"]
    processes = {}
    for name in names:
        module = {"trainer": "consumers.trainer", "evaluator": "consumers.evaluator",
                  "recorder": "consumers.recorder"}.get(name, "producers.rollout")
        path = write_settings(all_settings[name], config.out_dir / f"{name}.yaml")
        log_file = open(config.out_dir / f"{name}.log", "a")
        ranks = config.trainer_ranks if name == "trainer" else 1
        processes[name] = subprocess.Popen(command(module, path, ranks), stdout=log_file,
                                           stderr=subprocess.STDOUT,
                                           preexec_fn=die_with_parent)
    return processes


def exited(processes: dict[str, subprocess.Popen]) -> str | None:
    """The first daemon that has exited, as "NAME exited with code N"; None while all run."""
    for name, process in processes.items():
        if process.poll() is not None:
            return f"{name} exited with code {process.returncode}"
    return None


async def run_processes(config: RunConfig, model_dir: Path, evaluator: Evaluator,
                        stop: asyncio.Event, on_beat: Callable[[dict], None] | None) -> dict:
    """Producers and trainer (and with `fanout` the evaluator and recorder daemons) as separate
    processes on Kafka, until a bound is met; the clock starts when the trainer has announced
    a version and a producer, its engine built, has sent its first heartbeat. A daemon that
    exits before then (the trainer: with an error), or a producer that exits at all, fails the
    run (see its log)."""
    processes = start_daemons(config, model_dir)
    try:
        async with RunWatch(evaluator.bus, config.run, config.weights().public_key,
                            on_beat) as watch:
            spawned, spawned_at = time.monotonic(), time.time()
            trainer_done = lambda: processes["trainer"].poll() is not None  # noqa: E731
            await watch.until_started(evaluator, stop, lambda: exited(processes), trainer_done)
            # the clock starts when the daemons were ready (as they sent it, not when read here);
            # max_seconds counts from when it was read, so RL lasts at least that long
            started_at = min(max(evaluator.ready_at(), spawned_at), time.time())
            started = time.monotonic() - (time.time() - started_at)
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(evaluator.follow(stop, started))
                ended = await watch.until_done(stop, config.max_seconds, trainer_done,
                                               failed=lambda: _failed_producer(processes))
                stop.set()
            rl_seconds = time.monotonic() - started
    finally:
        await _stop_all(processes)
    if processes["trainer"].returncode not in (0, -signal.SIGTERM):
        raise MilesError(f"the trainer exited with code {processes['trainer'].returncode}; "
                         f"see {config.out_dir / 'trainer.log'}")
    return {"rl_seconds": rl_seconds, "rl_started_at": started_at,
            "engine_start_s": started - spawned, "ended_by": ended,
            "generate_s": sum(evaluator.producer_generate_s.values()),
            "episodes": producers_episodes(evaluator.producer_extra) if config.env else {}}


def _failed_producer(processes: dict[str, subprocess.Popen]) -> str | None:
    return exited({n: p for n, p in processes.items() if n.startswith("producer")})


async def _stop_all(processes: dict[str, subprocess.Popen]) -> None:
    for process in processes.values():
        if process.poll() is None:
            process.terminate()
    for process in processes.values():
        await asyncio.to_thread(process.wait, 120)
