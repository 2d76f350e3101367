"""`miles run CONFIG`: the whole loop on one machine, bounded by steps, epochs or seconds, and
resumable after a kill (`miles.train` is the same run from Python; `miles demo` is a preset).

Steps: the model (the user's `model_dir`, or else the built tiny model with its supervised warm
start, cached under ~/.cache/miles), held-out greedy accuracy, the training prompts fed
(`epochs` passes), producers and trainer run against each other until the first bound is met,
held-out accuracy again, `report.json`, `curves.png` and the policy exported to `out_dir/policy`.
The trainer signs its versions and heartbeats with the key pair in `out_dir/keys` (made if
missing); producers and the evaluator verify them and load weights only from `out_dir/weights`.

Bounds, whichever comes first: `max_steps` optimizer steps, `max_seconds` of RL, or the data:
once every fed prompt is committed by the producers and every trajectory group is judged by the
trainer (trained, dropped or dead-lettered; `miles.run_watch`), nothing more can come.

Embedded bus (default): producers and trainer run in this process on one event loop, each in its
own worker thread, on a durable embedded bus in `out_dir/bus` (`embedded://PATH`). Kafka bus:
they are separate processes (`python -m producers.rollout`, `python -m consumers.trainer`, under
`torchrun` for `trainer_ranks > 1`), which die with this one; this process feeds and evaluates.
Either way, `--resume` (`resume=True`) carries on a killed or stopped run from the trainer's
newest checkpoint, the producers' committed prompts and the records on the bus: no group is
trained twice or skipped (`out_dir/run.json` names the run and what was fed).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace

import torch

from miles.bus import open_bus
from miles.bus.security import KafkaSecurity
from miles.config import log_config
from miles.engines.base import MAX_STOP_STRINGS, LoraSettings, RolloutEngine
from miles.engines.vllm_engine import VLLMEngineSettings
from miles.engines.vllm_server import VLLMServerSettings
from miles.envs import EnvironmentFactory, SandboxLimits, ToolSettings, load_environment
from miles.episodes import EpisodeSettings, check_stop_strings
from miles.errors import ConfigError, MilesError
from miles.evaluation import EpisodeEval, Evaluator
from miles.feeder import feed
from miles.protocol.topics import run_topics, topic_name
from miles.rl.sampling import SamplingParams
from miles.rollout import RolloutConfig, RolloutWorker, episode_extras
from miles.run_daemons import producer_settings, run_processes
from miles.run_record import begin, bus_url, save_record, with_run_name
from miles.run_watch import RunWatch
from miles.service import configure_logging, run_service
from miles.sft import SFTConfig
from miles.tasks.arithmetic import Problem
from miles.tasks.datasets import DatasetFormat, load_problems
from miles.tasks.rewards import Scorer, resolve_reward
from miles.trackers import TrackerSettings, Trackers, open_trackers
from miles.warm_start import warm_start
from miles.trainer.learner import LearnerConfig
from miles.trainer.learner_process import LearnerProcess, LearnerProcessSettings
from miles.trainer.loop import LoopConfig, TrainerLoop
from miles.trainer.runner import StepRunner
from miles.weights.following import FollowConfig
from miles.weights.signing import PUBLIC_KEY_FILE, ensure_key_pair
from producers.rollout import ENGINES, build_engine



@dataclass(frozen=True, kw_only=True)
class RunConfig:
    bus: str = "embedded://"  # embedded:// (durable, in out_dir/bus) or kafka://HOST:PORT
    kafka: KafkaSecurity = field(default_factory=KafkaSecurity)  # TLS/SASL for every process
    out_dir: Path = Path("runs/run")
    run: str = ""  # topics are miles.RUN.*; "": the out_dir's name (and a time on Kafka)
    model_dir: Path | None = None  # the checkpoint to train (default: the built tiny model)
    prompts: str = "arithmetic"  # a built-in task, .jsonl, .parquet or a saved dataset folder
    dataset: DatasetFormat = field(default_factory=DatasetFormat)  # the prompts' field names
    env: str = ""  # the producer's environment (calculator, python, module:Name); "": single-turn
    episodes: EpisodeSettings = field(default_factory=EpisodeSettings)  # limits when env is set
    tools: ToolSettings = field(default_factory=ToolSettings)  # a tool environment's limits
    sandbox: SandboxLimits = field(default_factory=SandboxLimits)  # the python env's sandbox
    eval_prompts: str | None = None  # held-out problems (default: `prompts`' test split)
    reward: str = "exact_match"  # exact_match, math, format[:REGEX], rm:PATH or module:function
    reward_timeout_s: float = 10.0  # per reward call; a timed-out sample gets 0.0 and an error
    max_steps: int = 0  # optimizer steps in all (0: no bound)
    epochs: int = 1  # passes over the training prompts
    max_seconds: float = 0.0  # seconds of RL (0: no bound)
    engine: str = "hf"  # the producers': hf, vllm (in process) or vllm-server (a running server)
    vllm: VLLMEngineSettings = field(default_factory=VLLMEngineSettings)  # engine vllm
    vllm_server: VLLMServerSettings = field(default_factory=VLLMServerSettings)  # vllm-server
    producers: int = 1  # rollout producers (each with its own engine)
    trainer_ranks: int = 1  # Kafka: trainer processes under torchrun (FSDP2 ranks)
    torch_threads: int = 0  # torch's CPU threads per producer and per trainer rank; 0: this
    # machine's cores split evenly between them (they compute at the same time), at least 1
    max_in_flight: int = 0  # > 0: producers stream this many groups (docs/streaming.md)
    weight_update: str = "continue"  # streaming: continue, finish or restart running samples
    learner_process: bool = True  # embedded: the learner in a child process, with a GIL of its
    # own (in one process the event loop's Python holds its step back; docs/runs.md)
    fanout: bool = False  # Kafka: also run the evaluator and recorder daemons (fan-out consumers)
    max_staleness: int = 1
    eval_every_s: float = 30.0  # held-out evaluation at most this often while training (0: none)
    eval_problems: int = 500  # problems in each periodic evaluation (the final one uses all)
    eval_after_run: bool = False  # copy the version every eval_every_s, measure after training
    sft: SFTConfig = field(default_factory=SFTConfig)  # the built-in warm start's
    lora: LoraSettings | None = field(  # None: full fine-tuning (full weights hot-loaded)
        default_factory=lambda: LoraSettings(r=16, alpha=32))
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(
        n=8, temperature=1.0, max_new_tokens=5))
    learner: LearnerConfig = field(default_factory=lambda: LearnerConfig(lr=1e-3))
    groups_per_step: int = 32
    prompts_per_batch: int = 0  # the producer's batch (0: groups_per_step, one step's worth)
    checkpoint_every: int = 10  # steps between checkpoints (0: only at the end)
    keep_versions: int = 16  # newest weight versions kept in out_dir/weights (0: all)
    seed: int = 0  # the prompts' shuffle
    export_policy: bool = True  # write the final policy to out_dir/policy (merged LoRA)
    trackers: TrackerSettings = field(default_factory=TrackerSettings)  # TensorBoard, W&B, MLflow

    def __post_init__(self) -> None:
        for name in ("max_steps", "prompts_per_batch", "checkpoint_every", "keep_versions",
                     "torch_threads"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("epochs", "producers", "trainer_ranks"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_seconds", "eval_every_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.engine not in ENGINES:
            raise ConfigError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.trainer_ranks > 1 and self.embedded:
            raise ConfigError("trainer_ranks > 1 needs the Kafka bus (bus = \"kafka://...\"): "
                              "ranks are processes, the embedded bus lives in one")
        self.episodes.check_engine(self.engine)
        self.rollout().check_streaming(self.engine, self.env)

    @property
    def embedded(self) -> bool:
        return self.bus.startswith("embedded")

    def role_threads(self) -> int:
        """Torch CPU threads for each producer and each trainer rank (`torch_threads`)."""
        if self.torch_threads:
            return self.torch_threads
        return max(1, len(os.sched_getaffinity(0)) // (self.producers + self.trainer_ranks))

    def rollout(self, producer: int = 0) -> RolloutConfig:
        return RolloutConfig(run=self.run, producer_id=f"producer-{producer}",
                             sampling=self.sampling,
                             prompts_per_batch=self.prompts_per_batch or self.groups_per_step,
                             max_in_flight=self.max_in_flight, weight_update=self.weight_update,
                             max_staleness=self.max_staleness, seed=self.seed + producer,
                             groups_per_step=self.groups_per_step, weights=self.weights())

    def weights(self) -> FollowConfig:
        """Where the producers and the evaluator find the trainer's weights, and the public key
        of the pair the trainer signs with (its default, out_dir/keys, made by `train_run`)."""
        return FollowConfig(store=self.out_dir / "weights",
                            public_key=self.out_dir / "keys" / PUBLIC_KEY_FILE)

    def tracker_settings(self) -> TrackerSettings:
        """The daemons' trackers, writing under out_dir/trackers unless `trackers.dir`."""
        return replace(self.trackers, dir=self.trackers.dir or self.out_dir / "trackers")

    def loop(self) -> LoopConfig:
        return LoopConfig(run=self.run, out_dir=self.out_dir, groups_per_step=self.groups_per_step,
                          max_staleness=self.max_staleness, max_steps=self.max_steps,
                          checkpoint_every=self.checkpoint_every,
                          keep_versions=self.keep_versions)

    def problems(self, split: str) -> list[Problem]:
        source = self.prompts if split == "train" else (self.eval_prompts or self.prompts)
        return load_problems(source, split, fmt=self.dataset)


def run_trackers(config: RunConfig, role: str) -> Trackers:
    """The tracker run of one of this process's parts (`role`); the caller closes it."""
    return open_trackers(config.trackers, role=role, run=config.run,
                         default_dir=config.out_dir / "trackers", config=config)


async def check_door(config: RunConfig) -> None:
    """Before any model loads: each setting that cannot work is one ConfigError naming it (the
    model folder, the prompts and their fields, the reward, the environment, the bus)."""
    if config.model_dir is not None:
        _check_model(Path(config.model_dir))
    fields = "dataset.prompt_field, dataset.answer_field, dataset.id_field"
    for split in ("train", "test"):
        try:
            config.problems(split)
        except ConfigError as err:
            raise ConfigError(f"prompts: {err} (the field names are {fields})") from None
    scorer = resolve_reward(config.reward, timeout_s=config.reward_timeout_s)
    factory = environment(config, scorer)
    if factory is not None:  # the count only: the tokenizer comes with the engine
        check_stop_strings(engine_kind(config.engine), factory)
    try:
        async with open_bus(bus_url(config), config.kafka):
            pass
    except MilesError as err:
        raise ConfigError(f"bus: {config.bus} cannot be reached: {err}") from None


def engine_kind(name: str) -> SimpleNamespace:
    """What the door knows of engine `name` before it is built: how many stop strings one
    request may carry (a vLLM server takes 4)."""
    from miles.engines.vllm_server import VLLMServerEngine

    limit = VLLMServerEngine.max_stop_strings if name == "vllm-server" else MAX_STOP_STRINGS
    return SimpleNamespace(name=name, max_stop_strings=limit)


def _check_model(path: Path) -> None:
    from transformers import AutoConfig

    if not (path / "config.json").is_file():
        raise ConfigError(f"model_dir: {path} is not a Hugging Face checkpoint folder "
                          "(no config.json)")
    try:
        AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as err:
        raise ConfigError(f"model_dir: {path} does not load: {err}") from None


def environment(config: RunConfig, scorer: Scorer) -> EnvironmentFactory | None:
    """The run's environment factory (None: single-turn)."""
    return load_environment(config.env, reward=scorer, tools=config.tools,
                            sandbox=config.sandbox) if config.env else None


def episode_eval(config: RunConfig, scorer: Scorer) -> EpisodeEval | None:
    """Held-out evaluation through the run's environment, as the producer plays it."""
    factory = environment(config, scorer)
    if factory is None:
        return None
    return EpisodeEval(factory=factory, settings=config.episodes,
                       turn_tokens=config.sampling.max_new_tokens)


def embedded_engine(config: RunConfig, model_dir: Path, index: int = 0) -> RolloutEngine:
    """Embedded producer `index`'s engine, built as its daemon would build it (torch's threads
    set to `role_threads`, as `run_embedded` already did for the whole process)."""
    return build_engine(producer_settings(config, model_dir, index))


def step_runner(config: RunConfig, model_dir: Path) -> StepRunner | LearnerProcess:
    """The embedded trainer's runner: its learner in a child process (`learner_process`, which
    starts building at once: `wait_ready` before use) or in this one."""
    if config.learner_process:
        settings = LearnerProcessSettings(model_dir=model_dir, lora=config.lora,
                                          torch_threads=config.role_threads(),
                                          learner=config.learner, loop=config.loop())
        return LearnerProcess(settings, settings_path=config.out_dir / "learner.yaml")
    return StepRunner.build(model_dir, config.loop(), learner=config.learner, lora=config.lora)


async def run_embedded(config: RunConfig, model_dir: Path, evaluator: Evaluator,
                       stop: asyncio.Event, on_beat: Callable[[dict], None] | None) -> dict:
    """Producers and trainer in this process, until a bound is met (the clock starts once the
    producers' engines are up)."""
    # torch's thread count is the process's: the engines and the learner share it (and the
    # cores); one pool as wide as the machine for each would oversubscribe it
    threads = torch.get_num_threads()
    torch.set_num_threads(config.role_threads())
    try:
        return await _run_embedded(config, model_dir, evaluator, stop, on_beat)
    finally:
        torch.set_num_threads(threads)


async def _run_embedded(config: RunConfig, model_dir: Path, evaluator: Evaluator,
                        stop: asyncio.Event, on_beat: Callable[[dict], None] | None) -> dict:
    bus = evaluator.bus
    began = time.monotonic()
    runner = step_runner(config, model_dir)  # a learner process builds while the engines do
    engines, trackers = [], []
    try:
        engines += [embedded_engine(config, model_dir, i) for i in range(config.producers)]
        engine_start_s = time.monotonic() - began
        if isinstance(runner, LearnerProcess):
            await asyncio.to_thread(runner.wait_ready)
        trackers += [run_trackers(config, f"producer-{i}") for i in range(config.producers)]
        trackers.append(run_trackers(config, "trainer"))
        workers = [RolloutWorker(bus, engine, evaluator.scorer, config.rollout(i),
                                 env=environment(config, evaluator.scorer),
                                 episodes=config.episodes, trackers=trackers[i])
                   for i, engine in enumerate(engines)]
        trainer = TrainerLoop(bus, runner, trackers[-1])
        started, started_at = time.monotonic(), time.time()
        async with RunWatch(bus, config.run, config.weights().public_key, on_beat) as watch, \
                asyncio.TaskGroup() as tasks:
            for worker in workers:
                tasks.create_task(worker.run(stop))
            trained = tasks.create_task(trainer.run(stop))
            tasks.create_task(evaluator.follow(stop, started))
            ended = await watch.until_done(stop, config.max_seconds, trained.done)
            stop.set()
    finally:
        runner.close()
        for engine in engines:
            engine.close()
        for tracker in trackers:
            tracker.close()
    counts: Counter = Counter()
    for worker in workers:
        counts.update(worker.counts)
    return {"rl_seconds": time.monotonic() - started, "rl_started_at": started_at,
            "engine_start_s": engine_start_s,
            "ended_by": ended, "generate_s": counts["producer/generate_s"],
            "episodes": episode_extras(counts) if config.env else {}}


async def feed_once(bus, config: RunConfig, record: dict) -> None:
    """Feed the training prompts; after a kill, only those the killed run had not yet fed (the
    feed is deterministic: `epochs` passes shuffled with `seed`)."""
    problems = config.problems("train")
    total = len(problems) * config.epochs
    if record["fed"] < total:
        topic = topic_name(config.run, "prompts")
        on_bus = sum(end for _, end in (await bus.topic_offsets([topic])).values())
        await feed(bus, config.run, problems, epochs=config.epochs, seed=config.seed,
                   skip=on_bus)
        record["fed"] = total
        save_record(config, record)


async def train_run(config: RunConfig, stop: asyncio.Event, *, resume: bool = False,
                    fresh: bool = False, on_beat: Callable[[dict], None] | None = None) -> dict:
    """Warm start, evaluate, feed, train until a bound or `stop`, evaluate; the result (the
    report's fields). `on_beat` sees each trainer heartbeat's counters (a progress bar)."""
    from miles.demo_report import build_report

    began = time.monotonic()
    await check_door(config)
    model_dir = await asyncio.to_thread(warm_start, config, stop.is_set)  # signals heard
    warm_s = time.monotonic() - began
    held_out = config.problems("test")
    record = begin(config, resume=resume, fresh=fresh)
    ensure_key_pair(config.out_dir / "keys")  # the trainer's default pair, before any follower
    async with open_bus(bus_url(config), config.kafka) as bus:
        await bus.create_topics(run_topics(config.run, prompt_partitions=config.producers,
                                           trajectory_partitions=1))
        await feed_once(bus, config, record)
        scorer = resolve_reward(config.reward, timeout_s=config.reward_timeout_s)
        with run_trackers(config, "evaluator") as evaluated:
            evaluator = Evaluator(bus, config.run, model_dir, config.lora,
                                  held_out[:config.eval_problems], every_s=config.eval_every_s,
                                  scorer=scorer, weights=config.weights(),
                                  episodes=episode_eval(config, scorer), trackers=evaluated,
                                  after_run=config.eval_after_run)
            final = await evaluate_and_train(config, model_dir, evaluator, record, stop, on_beat)
    return build_report(config, final["result"], evaluator.curve,
                        initial=record["initial_accuracy"], final=final["accuracy"],
                        held_out=len(held_out), warm_s=warm_s,
                        wall_s=time.monotonic() - began, model_dir=model_dir)


async def evaluate_and_train(config: RunConfig, model_dir: Path, evaluator: Evaluator,
                             record: dict, stop: asyncio.Event,
                             on_beat: Callable[[dict], None] | None) -> dict:
    """Held-out accuracy before (once per run), the training, held-out accuracy after."""
    held_out = config.problems("test")
    async with evaluator:
        if record["initial_accuracy"] is None:
            record["initial_accuracy"] = await evaluator.measure(held_out)
            save_record(config, record)
        run = run_embedded if config.embedded else run_processes
        result = await run(config, model_dir, evaluator, stop, on_beat)
        await evaluator.measure_kept()
        await evaluator.load_final()
        return {"result": result, "accuracy": await evaluator.measure(held_out)}


class StepBar:
    """A progress bar of the trainer's steps (tqdm's, which draws itself in notebooks too)."""

    def __init__(self, total: int, *, enabled: bool):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total or None, unit="step", disable=not enabled)

    def update(self, beat: dict) -> None:
        step = int(beat.get("step", 0))
        if step > self.bar.n:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix(groups=int(beat.get("trainer/groups_trained", 0)))

    def __enter__(self) -> StepBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.close()


def finish(config: RunConfig, report: dict) -> dict:
    """Write the report and curves; export the policy (`export_policy`) once a version was
    trained."""
    from miles.demo_report import plot_curves
    from miles.weights.export import export_model

    if config.export_policy and report["policy_version"] > 0:
        policy = config.out_dir / "policy"
        shutil.rmtree(policy, ignore_errors=True)
        export_model(Path(report["model_dir"]), config.out_dir / "weights", policy)
        report["policy_dir"] = str(policy)
    (config.out_dir / "report.json").write_text(json.dumps(report, indent=2))
    plot_curves(report, config.out_dir / "metrics.jsonl", config.out_dir / "curves.png")
    return report


def main_run(config: RunConfig, *, resume: bool = False, fresh: bool = False,
             progress: bool = False) -> dict:
    """`miles run` (and `miles demo`, `fresh`; `miles.train`, `progress`): the run in this
    process, until a bound, the data's end or a signal; the report, also written to
    out_dir/report.json."""
    configure_logging()
    config = with_run_name(config, resume=resume)
    log_config(config)
    with StepBar(config.max_steps, enabled=progress) as bar:
        report = run_service(lambda stop: train_run(config, stop, resume=resume, fresh=fresh,
                                                    on_beat=bar.update))
    finish(config, report)
    gain = report["final_accuracy"] - report["initial_accuracy"]
    print(f"held-out accuracy {report['initial_accuracy']:.3f} -> {report['final_accuracy']:.3f} "
          f"({gain * 100:+.1f} points) in {report['steps']} steps, "
          f"{report['rl_seconds']:.0f} s of RL ({report['ended_by']}), "
          f"{report['wall_seconds']:.0f} s in all; report: {config.out_dir / 'report.json'}")
    return report
