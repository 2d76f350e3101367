"""Held-out evaluation: greedy accuracy of announced weight versions on a list of problems.

Greedy decoding is `top_k=1` sampling (the argmax token) through the same engine the producers
use, so evaluation sees exactly the weights and the tokenisation that generated the training data;
a problem counts as solved when the run's reward `Scorer` gives its answer a positive reward.
With an environment (`EpisodeEval`, the run's `env`), each problem is instead one greedy episode
played by the producer's `EpisodeRunner` through a fresh environment, with the run's episode
limits and per-turn budget: it counts as solved when the episode did not fail and its return
(the sum of its step rewards, what the producer trains on) is positive. A truncated episode
counts by the reward it got, a failed one as unsolved.
The `Evaluator` is one more consumer of the run's topics, in its own consumer groups: it follows
the control topic, loads each newer version (sha256-verified) at most every `every_s` seconds,
measures it, and keeps the curve (each point also goes to the experiment trackers as
`held_out/accuracy` at x = its policy version, `miles.trackers`); from the status topic it
keeps the producers' generation time. With `after_run` (the demo's default) it only copies the
newest verified version every `every_s` seconds during the run (milliseconds for an adapter)
and measures the copies after training (`measure_kept`), so the curve is the same but costs the
run no time or cores: on 2 CPUs, measuring during the run took 14% of the demo's steps.
"Newer" is the producers' rule (`miles.weights.following`): the newest trainer generation's
versions, going forward within it, so a trainer resumed from an older checkpoint is followed
and a fenced one ignored; an announced version counts only once it loads (its file inside the
weight store, of the announced size and sha256), so a forged one changes nothing; with
`weights.public_key` set, unsigned or badly signed versions and trainer heartbeats are ignored
(`miles.weights.signing`). The engine's
starting weights count as every trainer's version 0.
"""

from __future__ import annotations

import asyncio
import logging
import math
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from miles.bus import Bus
from miles.bus.decoding import DecodingConsumer
from miles.engines.base import LoraSettings, RolloutEngine
from miles.envs import EnvironmentFactory
from miles.episodes import (EpisodeRecord, EpisodeRunner, EpisodeSettings, check_stop_strings,
                            prompt_ids)
from miles.errors import MilesError, WeightsError
from miles.feeder import prompt_task
from miles.protocol import Heartbeat, WeightVersion
from miles.protocol.topics import topic_name
from miles.rl.sampling import SamplingParams
from miles.service import wait_or_stop
from miles.tasks.arithmetic import Problem
from miles.tasks.rewards import Scorer, exact_match
from miles.trackers import Trackers
from miles.weights.following import Announcements, FollowConfig, lineage, may_load_later
from miles.weights.signing import Verifier
from miles.weights.store import fetch_version

log = logging.getLogger(__name__)
EVAL_BATCH = 256
GREEDY = SamplingParams(n=1, temperature=1.0, top_k=1, max_new_tokens=8)


@dataclass(frozen=True, kw_only=True)
class EpisodeEval:
    """Held-out problems as greedy episodes through the run's environment."""

    factory: EnvironmentFactory  # builds one environment per episode (`load_environment`)
    settings: EpisodeSettings = field(default_factory=EpisodeSettings)  # the run's limits
    turn_tokens: int = 8  # tokens per model turn (the producer's `sampling.max_new_tokens`)


def greedy_answers(engine: RolloutEngine, problems: list[Problem], *,
                   max_new_tokens: int = 8) -> list[str]:
    """The greedy response to each problem, decoded and cut at end-of-sequence (blocking)."""
    params = replace(GREEDY, max_new_tokens=max_new_tokens)
    outputs = engine.generate([prompt_ids(engine, prompt_task(p)) for p in problems], params,
                              seed=0)
    return [engine.decode(c.token_ids[:-1] if c.finish_reason == "stop" else c.token_ids)
            for (c,) in outputs]


async def greedy_episodes(engine: RolloutEngine, problems: list[Problem],
                          episodes: EpisodeEval) -> list[EpisodeRecord]:
    """One greedy episode per problem through the producer's runner (generation in a worker
    thread, every episode's next turn batched into one engine call), in problem order."""

    async def generate(prompts, params, **kwargs):
        return await asyncio.to_thread(engine.generate, prompts, params, **kwargs)

    runner = EpisodeRunner(engine, episodes.factory, episodes.settings,
                           replace(GREEDY, max_new_tokens=episodes.turn_tokens),
                           generate_in_engine=generate)
    tasks = [(task, prompt_ids(engine, task)) for task in map(prompt_task, problems)]
    return [record for (record,) in await runner.run(tasks, seed=0)]


def solved(record: EpisodeRecord) -> bool:
    """Whether an episode counts as a success: not failed, and a positive return."""
    sample = None if record.failed else record.sample()
    return sample is not None and sample.reward > 0


async def greedy_accuracy(engine: RolloutEngine, problems: list[Problem], *,
                          scorer: Scorer | None = None, max_new_tokens: int = 8,
                          episodes: EpisodeEval | None = None) -> float:
    """Fraction of `problems` whose greedy answer earns a positive reward (default scorer:
    `exact_match`), or with `episodes` whose greedy episode succeeds (`solved`); generation
    runs in a worker thread, `EVAL_BATCH` problems at a time."""
    scorer = scorer or Scorer(exact_match)
    correct = 0
    if episodes is not None:
        for start in range(0, len(problems), EVAL_BATCH):
            records = await greedy_episodes(engine, problems[start:start + EVAL_BATCH], episodes)
            correct += sum(solved(r) for r in records)
        return correct / max(len(problems), 1)
    for start in range(0, len(problems), EVAL_BATCH):
        chunk = problems[start:start + EVAL_BATCH]
        texts = await asyncio.to_thread(greedy_answers, engine, chunk,
                                        max_new_tokens=max_new_tokens)
        scored = await scorer.score(texts, [p.answer for p in chunk], [p.prompt for p in chunk])
        correct += sum(s.reward > 0 for s in scored)
    return correct / max(len(problems), 1)


@dataclass
class Curve:
    """Held-out accuracy over wall-clock, and the time spent measuring it."""

    points: list[dict] = field(default_factory=list)
    eval_seconds: float = 0.0


class Evaluator:
    def __init__(self, bus: Bus, run: str, model_dir: Path, lora: LoraSettings | None,
                 problems: list[Problem], *, every_s: float, scorer: Scorer | None = None,
                 group: str = "evaluator", weights: FollowConfig | None = None,
                 episodes: EpisodeEval | None = None, trackers: Trackers | None = None,
                 after_run: bool = False):
        from miles.engines.hf import HFEngine

        self.bus, self.run, self.problems, self.every_s = bus, run, problems, every_s
        self.group = group  # consumer groups miles.<run>.<group>.<topic kind>
        self.scorer = scorer or Scorer(exact_match)
        self.episodes = episodes  # evaluate through the run's environment (None: single-turn)
        self.weights = weights or FollowConfig()  # the weight store and the trainer's key
        self.verifier = Verifier(self.weights.public_key, who="evaluator")
        self.engine = HFEngine(model_dir, lora=lora)
        if episodes is not None:
            check_stop_strings(self.engine, episodes.factory)
        self.curve = Curve()
        self.trackers = trackers or Trackers()  # each point, by version (opened by the caller)
        self.announced = -1  # policy version of the newest announcement taken as a candidate
        self.producer_generate_s: dict[str, float] = {}
        self.producer_extra: dict[str, dict] = {}  # each producer's newest heartbeat counters
        self.producers_seen: set[str] = set()  # ids of producers that sent a heartbeat
        self.first_seen_at = {"producer": math.inf, "version": math.inf}  # their created_at
        self._followed = Announcements()
        self._loaded: tuple[int, int] | None = None  # lineage of the loaded weights; None: base
        self.after_run = after_run  # keep a copy of the version every every_s, measure later
        self._kept: list[tuple[float, WeightVersion, Path]] = []  # (seconds, version, copy)
        self._kept_dir: Path | None = None

    async def __aenter__(self) -> Evaluator:
        def reader(kind: str, expected, **options) -> DecodingConsumer:
            consumer = self.bus.consumer([topic_name(self.run, kind)],
                                         group_id=f"miles.{self.run}.{self.group}.{kind}",
                                         **options)
            return DecodingConsumer(self.bus, consumer, dlq_topic=topic_name(self.run, "dlq"),
                                    expected=expected, name=self.group)

        self._control = reader("control", WeightVersion)
        self._status = reader("status", Heartbeat, from_beginning=False)
        for item in (self._control, self._status):
            await item.consumer.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for item in (self._control, self._status):
            await item.consumer.close()

    async def measure(self, problems: list[Problem] | None = None) -> float:
        """Greedy accuracy of the loaded weights on `problems` (default: the curve's)."""
        problems = self.problems if problems is None else problems
        accuracy = await greedy_accuracy(self.engine, problems, scorer=self.scorer,
                                         episodes=self.episodes)
        log.info("held-out accuracy %.3f on %d problems at version %d", accuracy, len(problems),
                 self.engine.policy_version)
        return accuracy

    async def read_topics(self, wait_s: float = 0.05) -> None:
        """Take in everything new on the status and control topics (status first: a newer
        trainer's heartbeat fences the versions its predecessor announces after it)."""
        for item in await self._status.poll(timeout_s=wait_s):
            beat = item.value
            if beat.role == "trainer":
                why = self.verifier.refusal(beat)
                if why is None:
                    self._followed.fence(beat.trainer_generation)
                else:
                    log.warning("evaluation ignores a trainer heartbeat: %s", why)
            elif beat.role == "producer":
                self.producers_seen.add(beat.producer_id)
                began = beat.extra.get("started_at", beat.created_at)  # its engine built
                self._seen("producer", began if isinstance(began, float) else beat.created_at)
                self.producer_extra[beat.producer_id] = dict(beat.extra)
                if "generate_s" in beat.extra:
                    self.producer_generate_s[beat.producer_id] = float(beat.extra["generate_s"])
        # up to the control topic's end as it stands now: reading until a poll comes back
        # empty never returned while a trainer announced more often than `wait_s`, and taking
        # only what the client had fetched fell behind a fast trainer until every version it
        # saw was pruned
        consumer = self._control.consumer
        ends = await consumer.end_offsets(consumer.assignment())
        while items := await self._control.poll(timeout_s=wait_s):
            for item in items:
                self._offer(item.value)
            if all([await consumer.position(tp) >= end for tp, end in ends.items()]):
                break

    def _offer(self, version: WeightVersion) -> None:
        why = self.verifier.refusal(version) or self._followed.refusal(version)
        if why is not None:
            log.info("evaluation ignores version %d: %s", version.policy_version, why)
            return
        self._followed.offer(version)
        self.announced = version.policy_version
        self._seen("version", version.created_at)

    def _seen(self, kind: str, created_at: float) -> None:
        if math.isfinite(created_at):
            self.first_seen_at[kind] = min(self.first_seen_at[kind], created_at)

    def ready_at(self) -> float:
        """When (`time.time()`) the run could first train: the later of the first producer's
        start (its heartbeats' `started_at`, once its engine was built) and the first announced
        version's creation (inf until both are seen)."""
        return max(self.first_seen_at.values())

    async def wait_for_version(self, version: int, stop: asyncio.Event) -> None:
        while self.announced < version and not stop.is_set():
            await self.read_topics(wait_s=0.2)

    async def wait_for_producer(self, stop: asyncio.Event) -> None:
        """Until some producer has sent a heartbeat (it does once its engine is built)."""
        while not self.producers_seen and not stop.is_set():
            await self.read_topics(wait_s=0.2)

    async def load_newest(self, keep: Callable[[Path, WeightVersion], None] | None = None
                          ) -> bool:
        """Load the newest candidate that loads, if it would replace the loaded weights (the
        base weights count as every generation's version 0); with `keep`, hand its verified
        folder to `keep` instead of the engine."""
        newer = [v for v in self._followed.newer_than(self._loaded or (0, 0))
                 if self._loaded is not None or v.policy_version > 0]
        for version in newer:
            if await self._load(version, keep):
                return True
        return False

    async def _load(self, version: WeightVersion,
                    keep: Callable[[Path, WeightVersion], None] | None = None) -> bool:
        """Fetch, verify and apply (or `keep`) `version`; a candidate that fails is dropped
        unless it may load later (`may_load_later`; a pruned file is replaced by newer
        announcements)."""
        new_lineage = version.trainer_generation > (self._loaded or (0, 0))[0]
        try:
            folder = await asyncio.to_thread(fetch_version, version, self.weights.store)
            if keep is not None:
                await asyncio.to_thread(keep, folder, version)
            else:
                await asyncio.to_thread(self.engine.load_version, folder, version.policy_version,
                                        version.format, new_lineage=new_lineage)
        except MilesError as err:
            if not may_load_later(err):
                self._followed.drop(version)
            log.warning("evaluation skips version %d: %s", version.policy_version, err)
            return False
        self._loaded = lineage(version)
        self._followed.verified(version)
        return True

    async def follow(self, stop: asyncio.Event, started: float) -> None:
        """Every `every_s` seconds until `stop` (0: never), the newest version: measured now,
        or with `after_run` copied and measured by `measure_kept` after training."""
        if self.every_s <= 0:
            await stop.wait()
            return
        while not await wait_or_stop(stop, self.every_s):
            await self.read_topics()
            seconds = round(time.monotonic() - started, 2)
            if self.after_run:
                await self.load_newest(keep=lambda folder, v: self._keep(folder, v, seconds))
            elif await self.load_newest():
                began = time.perf_counter()
                accuracy = await self.measure()
                self.curve.eval_seconds += time.perf_counter() - began
                self._point(round(time.monotonic() - started, 2), self.engine.policy_version,
                            accuracy)

    def _keep(self, folder: Path, version: WeightVersion, seconds: float) -> None:
        if self._kept_dir is None:
            self._kept_dir = Path(tempfile.mkdtemp(prefix="miles-eval-"))
        copy = self._kept_dir / f"{len(self._kept):06d}"
        try:
            shutil.copytree(folder, copy)
        except OSError as err:
            raise WeightsError(f"version {version.policy_version}: cannot copy {folder}: "
                               f"{err}") from err
        self._kept.append((seconds, version, copy))

    async def measure_kept(self) -> None:
        """After training (`after_run`): measure each version kept during the run, in order,
        into the curve at the second it was taken; the copies are deleted."""
        generation = 0
        for seconds, version, folder in self._kept:
            await asyncio.to_thread(self.engine.load_version, folder, version.policy_version,
                                    version.format,
                                    new_lineage=version.trainer_generation > generation)
            generation = version.trainer_generation
            self._point(seconds, version.policy_version, await self.measure())
        self._kept.clear()
        if self._kept_dir is not None:
            shutil.rmtree(self._kept_dir, ignore_errors=True)

    def _point(self, seconds: float, policy_version: int, accuracy: float) -> None:
        self.curve.points.append({"seconds": seconds, "policy_version": policy_version,
                                  "accuracy": accuracy})
        self.trackers.log({"held_out/accuracy": accuracy, "held_out/seconds": seconds},
                          policy_version)

    async def load_final(self, settle_s: float = 2.0) -> None:
        """After training: read the topics until quiet, then load the last version."""
        deadline = time.monotonic() + settle_s
        while time.monotonic() < deadline:
            await self.read_topics(wait_s=0.2)
        await self.load_newest()
