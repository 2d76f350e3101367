"""`miles demo`: the whole loop on one machine, learning for real on CPUs (the report:
`miles.demo_report`).

Steps: build the tiny model and its supervised warm start (cached under ~/.cache/miles), measure
held-out greedy accuracy, feed the training prompts, run rollout producer and trainer against
each other for `rl_seconds` of wall-clock, measure held-out accuracy again, write
`report.json` and `curves.png`. The trainer signs its versions and heartbeats with the key pair
in `out_dir/keys` (made if missing), and the producer and the evaluator verify them with its
public key and load weights only from `out_dir/weights` (docs/control-plane.md).

Embedded bus (default): producer and trainer run in this process on one event loop, each in its
own worker thread (generation is the smaller half, so both keep torch's default threads). Kafka bus:
producer and trainer are separate processes (`python -m producers.rollout`,
`python -m consumers.trainer`); this process feeds the prompts and evaluates. Its `kafka`
section (TLS/SASL, or `MILES_KAFKA__*`) is written into each daemon's settings file, so every
process of a demo connects as the same user (a deployment gives each role its own,
docs/security.md); the password stays in the environment or its file.

While training runs an evaluator follows the announced weight versions and measures held-out
accuracy on `eval_problems` problems at most every `eval_every_s` seconds; its time counts in the
RL wall-clock (nothing is paused for it) and is reported as its own fraction.

With `trackers.report_to` (docs/trackers.md) the trainer, the producer and the evaluator each
log to their own tracker run, `demo-trainer`, `demo-producer-0`, `demo-evaluator` (on Kafka,
the daemons through their settings), under out_dir/trackers unless `trackers.dir` is set.

Multi-turn (`env`, `miles demo --env multiplication`): the producer plays episodes through the
environment (both buses; the daemons' settings carry `env` and `episodes`), the warm start is
the task's format pairs (`WARM_STARTS`), and held-out success is one greedy episode per problem
through the same environment (`miles.evaluation.EpisodeEval`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import yaml

from consumers.trainer import TrainerSettings
from miles.bus import open_bus
from miles.bus.security import KafkaSecurity
from miles.config import log_config
from miles.demo_report import build_report, plot_curves, producers_episodes
from miles.engines.base import LoraSettings, RolloutEngine
from miles.engines.hf import HFEngine
from miles.engines.vllm_engine import VLLMEngineSettings
from miles.engines.vllm_server import VLLMServerSettings
from miles.envs import EnvironmentFactory, load_environment
from miles.episodes import EpisodeSettings
from miles.errors import ConfigError
from miles.evaluation import EpisodeEval, Evaluator
from miles.feeder import feed
from miles.protocol.topics import run_topics
from miles.rl.sampling import SamplingParams
from miles.rollout import RolloutConfig, RolloutWorker, episode_extras
from miles.service import configure_logging, run_service, wait_or_stop
from miles.sft import SFTConfig, supervised_warm_start, teacher_forced_probe
from miles.tasks.arithmetic import Problem
from miles.tasks.datasets import BUILT_IN, load_problems
from miles.tasks.multiplication import warm_start_problems
from miles.tasks.rewards import Scorer, resolve_reward
from miles.tasks.tiny_model import build_tiny_model
from miles.trackers import TrackerSettings, Trackers, open_trackers
from miles.trainer.learner import Learner, LearnerConfig
from miles.trainer.loop import LoopConfig, TrainerLoop
from miles.trainer.runner import StepRunner
from miles.weights.following import FollowConfig
from miles.weights.signing import PUBLIC_KEY_FILE, ensure_key_pair
from miles.weights.store import base_model_id
from producers.rollout import ENGINES, ProducerSettings, build_engine

log = logging.getLogger(__name__)
CACHE = Path.home() / ".cache" / "miles" / "demo"
ENV_DEMOS: dict[str, dict[str, str]] = {
    "multiplication": {"prompts": "multiplication", "env": "calculator",
                       "sampling.max_new_tokens": "32", "episodes.max_turns": "4",
                       "episodes.max_total_tokens": "58", "sft.steps": "1500",
                       "sft.stop_at_success": "0.2", "sft.check_every": "5", "lora": "null",
                       "learner.lr": "2e-4", "eval_every_s": "20"},
}
"""`miles demo --env NAME`: the settings of each built-in multi-turn demo (`--set` overrides
them). multiplication: two-digit products with the calculator; a turn has room for the call
(28 tokens), an episode for call, result and answer within the tiny model's 64 positions. The
copying is learnt abruptly in SFT (0.0 to 0.85 held-out success within a few dozen steps, at a
step that depends on the machine's numerics), so the warm start stops once 20% of 200 held-back
problems are reproduced (`sft.stop_at_success`; measured: step 355 and held-out 0.164 on one
machine, step 500 and 0.244 on another), leaving RL room. RL trains the full model at lr 2e-4
(+50.6 points in 180 s, +25 after 107 s; lr 4e-4: +33 in 180 s; LoRA at 1e-3 or 4e-3 learnt
3-5 points in 120-180 s; full fine-tuning at 1e-3 collapsed) and evaluates every 20 s."""
WARM_STARTS: dict[tuple[str, str], Callable[[list[Problem]], list[Problem]]] = {
    ("multiplication", "calculator"): warm_start_problems,
}
"""(task, env) -> the supervised pairs that teach the environment's format to the task's
training problems; any other pair is warmed up on the problems' answers (single-turn)."""
PROBE_PROBLEMS = 200  # training problems held back from the SFT to measure its success
CHAT_TASKS = ("multiplication",)  # tasks whose episodes need the tag characters (chat tokenizer)


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    bus: str = "embedded://"
    kafka: KafkaSecurity = field(default_factory=KafkaSecurity)  # TLS/SASL for every process
    out_dir: Path = Path("runs/demo")
    run: str = ""  # topics are miles.RUN.*; "": "demo" embedded, "demo-<UTC time>" on Kafka
    model_dir: Path | None = None  # a checkpoint to start from (default: the built tiny model)
    prompts: str = "arithmetic"  # a built-in task (arithmetic[-plain], multiplication) or JSONL
    env: str = ""  # the producer's environment (calculator, python, module:Name); "": single-turn
    episodes: EpisodeSettings = field(default_factory=EpisodeSettings)  # limits when env is set
    eval_prompts: str | None = None  # JSONL for held-out evaluation (default: `prompts`' test)
    reward: str = "exact_match"  # exact_match, math, format[:REGEX], rm:PATH or module:function
    reward_timeout_s: float = 10.0  # per reward call; a timed-out sample gets 0.0 and an error
    rl_seconds: float = 120.0
    engine: str = "hf"  # the producer's: hf, vllm (in process) or vllm-server (a running server)
    vllm: VLLMEngineSettings = field(default_factory=VLLMEngineSettings)  # engine vllm
    vllm_server: VLLMServerSettings = field(default_factory=VLLMServerSettings)  # vllm-server
    fanout: bool = False  # Kafka: also run the evaluator and recorder daemons (fan-out consumers)
    max_staleness: int = 1
    eval_every_s: float = 10.0
    eval_problems: int = 500
    sft: SFTConfig = field(default_factory=SFTConfig)
    lora: LoraSettings | None = field(  # None: full fine-tuning (full weights hot-loaded)
        default_factory=lambda: LoraSettings(r=16, alpha=32))
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(
        n=8, temperature=1.0, max_new_tokens=5))
    learner: LearnerConfig = field(default_factory=lambda: LearnerConfig(lr=1e-3))
    groups_per_step: int = 32
    prompts_per_batch: int = 0  # the producer's batch (0: groups_per_step, one step's worth)
    trackers: TrackerSettings = field(default_factory=TrackerSettings)  # TensorBoard, W&B, MLflow

    def __post_init__(self) -> None:
        if self.rl_seconds <= 0:
            raise ConfigError(f"rl_seconds must be > 0, got {self.rl_seconds}")
        if self.prompts_per_batch < 0:
            raise ConfigError(f"prompts_per_batch must be >= 0, got {self.prompts_per_batch}")
        if self.engine not in ENGINES:
            raise ConfigError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        self.episodes.check_engine(self.engine)

    def rollout(self) -> RolloutConfig:
        return RolloutConfig(run=self.run, producer_id="producer-0", sampling=self.sampling,
                             prompts_per_batch=self.prompts_per_batch or self.groups_per_step,
                             max_staleness=self.max_staleness,
                             groups_per_step=self.groups_per_step, weights=self.weights())

    def weights(self) -> FollowConfig:
        """Where the producer and the evaluator find the trainer's weights, and the public key
        of the pair the trainer signs with (its default, out_dir/keys, made by `run_demo`)."""
        return FollowConfig(store=self.out_dir / "weights",
                            public_key=self.out_dir / "keys" / PUBLIC_KEY_FILE)

    def tracker_settings(self) -> TrackerSettings:
        """The daemons' trackers, writing under out_dir/trackers unless `trackers.dir`."""
        return replace(self.trackers, dir=self.trackers.dir or self.out_dir / "trackers")

    def loop(self) -> LoopConfig:
        return LoopConfig(run=self.run, out_dir=self.out_dir, groups_per_step=self.groups_per_step,
                          max_staleness=self.max_staleness, checkpoint_every=0)


def demo_trackers(config: DemoConfig, role: str) -> Trackers:
    """The tracker run of one of this process's parts (`role`); the caller closes it."""
    return open_trackers(config.trackers, role=role, run=config.run,
                         default_dir=config.out_dir / "trackers", config=config)


def env_overrides(name: str | None) -> list[str]:
    """`--env NAME` as settings, before the other flags and `--set` (which win): a built-in
    demo's (`ENV_DEMOS`), or `env=NAME` for the producer's environment."""
    if name is None:
        return []
    if name in ENV_DEMOS:
        return [f"{key}={value}" for key, value in ENV_DEMOS[name].items()]
    return [f"env={name}"]


def warm_start(config: DemoConfig, should_stop: Callable[[], bool] = lambda: False) -> Path:
    """The model RL starts from: the user's, or the cached tiny model after `miles sft` on the
    task's warm-start pairs (`WARM_STARTS`), cached by the SFT settings, task and format. With
    `sft.stop_at_success` the first `PROBE_PROBLEMS` training problems are held back from the
    SFT and probed (`teacher_forced_probe`: every pair of a problem reproduced) until that
    share of them succeeds. Blocking; StoppedError once `should_stop()`."""
    if config.model_dir is not None:
        return Path(config.model_dir)
    task = config.prompts if config.prompts in BUILT_IN else "arithmetic"
    pairs = WARM_STARTS.get((task, config.env))
    chat = task in CHAT_TASKS
    keyed = {**asdict(config.sft), "task": task}
    if pairs is not None or chat:  # the arithmetic demos keep their cache key
        keyed |= {"env": config.env if pairs is not None else "", "chat": chat}
    key = hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:12]
    sft_dir = CACHE / f"sft-{key}"
    if (sft_dir / "config.json").exists():
        return sft_dir
    base = build_tiny_model(CACHE / ("base-chat" if chat else "base"), chat=chat)
    log.info("building the supervised warm start in %s", sft_dir)
    examples = pairs or (lambda problems: problems)
    problems = load_problems(task, "train")
    probe = None
    if config.sft.stop_at_success > 0:
        probe = teacher_forced_probe([examples([p]) for p in problems[:PROBE_PROBLEMS]])
        problems = problems[PROBE_PROBLEMS:]
    staging = sft_dir.with_name(sft_dir.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    supervised_warm_start(base, staging, examples(problems), config.sft, probe=probe,
                          should_stop=should_stop)
    staging.rename(sft_dir)
    return sft_dir


def environment(config: DemoConfig, scorer: Scorer) -> EnvironmentFactory | None:
    """The run's environment factory (None: single-turn)."""
    return load_environment(config.env, reward=scorer) if config.env else None


def episode_eval(config: DemoConfig, scorer: Scorer) -> EpisodeEval | None:
    """Held-out evaluation through the run's environment, as the producer plays it."""
    factory = environment(config, scorer)
    if factory is None:
        return None
    return EpisodeEval(factory=factory, settings=config.episodes,
                       turn_tokens=config.sampling.max_new_tokens)


async def run_embedded(config: DemoConfig, model_dir: Path, evaluator: Evaluator,
                       stop: asyncio.Event) -> dict:
    """Producer and trainer in this process on the embedded bus, for `rl_seconds` (the clock
    starts once the producer's engine is up)."""
    bus = evaluator.bus
    began = time.monotonic()
    engine = demo_engine(config, model_dir)
    engine_start_s = time.monotonic() - began
    try:
        with demo_trackers(config, "producer-0") as produced, \
                demo_trackers(config, "trainer") as trained:
            worker = RolloutWorker(bus, engine, evaluator.scorer, config.rollout(),
                                   env=environment(config, evaluator.scorer),
                                   episodes=config.episodes, trackers=produced)
            learner = Learner(model_dir, config.learner, lora=config.lora)
            trainer = TrainerLoop(bus, StepRunner(learner, config.loop(),
                                                  base_model=base_model_id(model_dir)), trained)
            started = time.monotonic()
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(worker.run(stop))
                tasks.create_task(trainer.run(stop))
                tasks.create_task(evaluator.follow(stop, started))
                await wait_or_stop(stop, config.rl_seconds)
                stop.set()
    finally:
        engine.close()
    return {"rl_seconds": time.monotonic() - started, "engine_start_s": engine_start_s,
            "generate_s": worker.counts["producer/generate_s"],
            "episodes": episode_extras(worker.counts) if config.env else {}}


def demo_engine(config: DemoConfig, model_dir: Path) -> RolloutEngine:
    """The embedded producer's engine. The Hugging Face one is built here, not by the
    producer's builder, which would set torch's threads for the trainer in this process too."""
    if config.engine == "hf":
        return HFEngine(model_dir, lora=config.lora)
    return build_engine(daemon_settings(config, model_dir)["producer"])


def daemon_settings(config: DemoConfig, model_dir: Path) -> dict:
    """The daemons' settings for this demo, as they read them, by name."""
    from consumers.evaluator import EvaluatorSettings
    from consumers.recorder import RecorderSettings

    common = {"bus": config.bus, "kafka": config.kafka, "model_dir": model_dir,
              "lora": config.lora}
    return {
        "producer": ProducerSettings(**common, reward=config.reward, torch_threads=1,
                                     reward_timeout_s=config.reward_timeout_s,
                                     engine=config.engine, vllm=config.vllm,
                                     vllm_server=config.vllm_server, rollout=config.rollout(),
                                     env=config.env, episodes=config.episodes,
                                     trackers=config.tracker_settings()),
        "trainer": TrainerSettings(**common, torch_threads=1, learner=config.learner,
                                   loop=config.loop(), trackers=config.tracker_settings()),
        "evaluator": EvaluatorSettings(**common, run=config.run, prompts=config.prompts,
                                       reward=config.reward, every_s=config.eval_every_s,
                                       out=config.out_dir / "evaluation.jsonl",
                                       weights=config.weights(), env=config.env,
                                       episodes=config.episodes,
                                       turn_tokens=config.sampling.max_new_tokens,
                                       trackers=config.tracker_settings()),
        "recorder": RecorderSettings(bus=config.bus, kafka=config.kafka, run=config.run,
                                     out_dir=config.out_dir / "archive", file_seconds=30.0),
    }


def write_settings(settings, path: Path) -> Path:
    plain = json.loads(json.dumps(asdict(settings), default=str))
    path.write_text(yaml.safe_dump(plain, sort_keys=False))
    return path


async def run_processes(config: DemoConfig, model_dir: Path, evaluator: Evaluator,
                        stop: asyncio.Event) -> dict:
    """Producer and trainer (and with `fanout` the evaluator and recorder daemons) as separate
    processes on Kafka; the clock starts when the trainer has announced its first version and
    the producer, its engine built, has sent its first heartbeat."""
    daemons = [("consumers.trainer", "trainer"), ("producers.rollout", "producer")]
    if config.fanout:
        daemons += [("consumers.evaluator", "evaluator"), ("consumers.recorder", "recorder")]
    all_settings = daemon_settings(config, model_dir)
    processes = []
    for module, name in daemons:
        settings = all_settings[name]
        path = write_settings(settings, config.out_dir / f"{name}.yaml")
        log_file = open(config.out_dir / f"{name}.log", "w")
        processes.append(subprocess.Popen([sys.executable, "-m", module, "--config", str(path)],
                                          stdout=log_file, stderr=subprocess.STDOUT))
    try:
        spawned = time.monotonic()
        await evaluator.wait_for_version(0, stop)
        await evaluator.wait_for_producer(stop)
        started = time.monotonic()
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(evaluator.follow(stop, started))
            await wait_or_stop(stop, config.rl_seconds)
            stop.set()
        rl_seconds = time.monotonic() - started
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            await asyncio.to_thread(process.wait, 120)
    return {"rl_seconds": rl_seconds, "engine_start_s": started - spawned,
            "generate_s": sum(evaluator.producer_generate_s.values()),
            "episodes": producers_episodes(evaluator.producer_extra) if config.env else {}}


async def run_demo(config: DemoConfig, stop: asyncio.Event) -> dict:
    """Warm start, evaluate, train for `rl_seconds` (or until `stop`), evaluate, report."""
    began = time.monotonic()
    model_dir = await asyncio.to_thread(warm_start, config, stop.is_set)  # signals heard
    warm_s = time.monotonic() - began
    held_out = load_problems(config.eval_prompts or config.prompts, "test")
    fresh_out_dir(config.out_dir)
    ensure_key_pair(config.out_dir / "keys")  # the trainer's default pair, before any follower
    async with open_bus(config.bus, config.kafka) as bus:
        await bus.create_topics(run_topics(config.run, prompt_partitions=1,
                                           trajectory_partitions=1))
        await feed(bus, config.run, load_problems(config.prompts, "train"), epochs=2)
        scorer = resolve_reward(config.reward, timeout_s=config.reward_timeout_s)
        with demo_trackers(config, "evaluator") as evaluated:
            evaluator = Evaluator(bus, config.run, model_dir, config.lora,
                                  held_out[:config.eval_problems], every_s=config.eval_every_s,
                                  scorer=scorer, weights=config.weights(),
                                  episodes=episode_eval(config, scorer), trackers=evaluated)
            async with evaluator:
                initial = await evaluator.measure(held_out)
                run = run_embedded if config.bus.startswith("embedded") else run_processes
                result = await run(config, model_dir, evaluator, stop)
                await evaluator.load_final()
                final = await evaluator.measure(held_out)
    return build_report(config, result, evaluator.curve, initial=initial, final=final,
                        held_out=len(held_out), warm_s=warm_s, wall_s=time.monotonic() - began,
                        model_dir=model_dir)


def fresh_out_dir(out_dir: Path) -> None:
    """A demo always starts from its warm start: drop what an earlier run left in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("checkpoints", "weights"):
        shutil.rmtree(out_dir / name, ignore_errors=True)
    for name in ("metrics.jsonl", "ledger.jsonl", "samples.jsonl", "report.json", "curves.png"):
        (out_dir / name).unlink(missing_ok=True)


def with_run_name(config: DemoConfig) -> DemoConfig:
    """A demo starts from its warm start, so on Kafka, whose topics outlive a run, each run gets
    topics of its own unless `run` is set."""
    if config.run:
        return config
    if config.bus.startswith("embedded"):
        return replace(config, run="demo")
    return replace(config, run=time.strftime("demo-%Y%m%d-%H%M%S", time.gmtime()))


def main_demo(config: DemoConfig) -> int:
    configure_logging()
    config = with_run_name(config)
    log_config(config)
    report = run_service(lambda stop: run_demo(config, stop))
    (config.out_dir / "report.json").write_text(json.dumps(report, indent=2))
    plot_curves(report, config.out_dir / "metrics.jsonl", config.out_dir / "curves.png")
    gain = report["final_accuracy"] - report["initial_accuracy"]
    print(f"held-out accuracy {report['initial_accuracy']:.3f} -> {report['final_accuracy']:.3f} "
          f"({gain * 100:+.1f} points) in {report['steps']} steps, "
          f"{report['rl_seconds']:.0f} s of RL, {report['wall_seconds']:.0f} s in all; "
          f"report: {config.out_dir / 'report.json'}")
    return 0
