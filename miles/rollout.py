"""The rollout worker: prompts in, scored trajectory groups out, weights followed on the way.

Three loops share one engine:
- generation: take a batch of `PromptTask`s (the producers' consumer group shares them), sample
  `n` responses each in the engine's executor thread, score each group with one `Scorer` call
  (groups one after another: a reward model's call never waits, timer running, behind another),
  or, with an environment (`env=`), play `n` episodes per prompt (`miles.rollout_groups`,
  `miles.episodes`); publish one `TrajectoryGroup` per prompt, dead-letter each failed
  episode (about its prompt's record, `miles.rollout_groups`), then commit the prompts
  (`miles.bus.commits`). When
  a rebalance or a graceful stop revokes partitions, the revocation waits for the batch in
  flight and commits what is published, so graceful membership changes duplicate nothing. A
  producer killed before its commit, or one whose commit the group refuses because membership
  already changed (counted as `commit_failures`, never fatal), has those prompts re-delivered
  to the partition's owner: they are generated twice (at-least-once; each group has a unique
  id). A batch the engine fails on (`EngineError`) is rewound and retried after
  `ENGINE_RETRY_S`, counted and reported in a heartbeat. A prompt no engine of this vocabulary
  can take (no tokens, token ids outside it) is the prompt's fault, not the engine's: it is
  dead-lettered and committed past with its batch, never retried (`bad_prompts`). So is a
  single-turn prompt this engine cannot take for what it asks (`rejected_prompts`): one that
  fills the engine's context, or one the engine refuses (`EngineRejectedError`; the letter's
  reason `prompt rejected: <why>`, `miles.rollout_groups`); batched or streamed, the rest goes on.
  Streaming (`max_in_flight` > 0, `miles.rollout_stream`, docs/streaming.md) replaces batches:
  up to `max_in_flight` groups in generation at once, each published as it ends and its
  prompt committed out of order (`StreamOffsets`), new prompts taken as admission allows;
  a version arriving mid-generation is loaded under `weight_update`.
- control: read the control topic from its start, catch up, then load the newest `WeightVersion`
  that verifies and loads (`miles.weights.follower.WeightFollower`: the newest trainer
  generation's versions, files checked against the weight store, signatures against
  `weights.public_key`; a version that fails changes nothing); obey pause/resume/drain/stop
  `Command`s (signed, when versions are).
- status: read trainer heartbeats (its policy version and how many trajectory records it has
  consumed; a fenced generation's are ignored) and publish this producer's heartbeat; its
  counters (`producer/*`, with the heartbeat's number as x) also go to the experiment trackers
  (`miles.trackers`).

Admission control (`miles.admission`): the worker only takes a batch when it would still be
within `max_staleness` when trained; otherwise it waits for the trainer or for a newer version,
and says so in its heartbeat (`waiting`: the version it needs, and which newer ones failed to
load). A newest version that does not load (a missing file) falls back to the newest one that
does and is retried (`miles.weights.follower`), so a lost file costs freshness, not the run;
with no loadable version fresh enough, admission keeps waiting and reports it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from miles.admission import TrainerView, admissible, required_version
from miles.bus import Bus, TopicPartition
from miles.bus.commits import DoneOffsets, StreamOffsets
from miles.bus.decoding import Decoded, DecodingConsumer
from miles.engines.base import RolloutEngine, prompt_problem
from miles.envs import EnvironmentFactory
from miles.episodes import EpisodeSettings, prompt_ids
from miles.errors import ConfigError, EngineError, EngineRejectedError, EpisodeError
from miles.protocol import ALL_TARGETS, Command, Heartbeat, PromptTask, WeightVersion, encode
from miles.protocol.records import rejected_prompt_reason
from miles.protocol.topics import topic_name
from miles.rl.sampling import SamplingParams
from miles.service import wait_or_stop
from miles.rollout_groups import EPISODE_COUNTERS, EpisodeGroups, SingleTurnGroups
from miles.rollout_stream import (ENGINE_RETRY_S, WEIGHT_UPDATES, AsyncRequestStream,
                                  GroupStream, RequestStream)
from miles.tasks.rewards import Scorer
from miles.trackers import Trackers
from miles.weights.follower import WeightFollower
from miles.weights.following import FollowConfig

log = logging.getLogger(__name__)
ADMISSION_POLL_S = 0.02
WAIT_WARN_S = 30.0  # admission waiting this long is logged (a stalled trainer or weights)
STOP_WAIT_S = 30.0  # streaming: how long a stop or drain waits for the groups in flight
STREAMING_ENGINES = ("hf", "vllm", "vllm-server")  # a continuous batcher, or concurrent requests


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    run: str = "demo"  # topics are miles.<run>.*
    producer_id: str = "producer-0"
    sampling: SamplingParams = field(default_factory=SamplingParams)
    prompts_per_batch: int = 32  # prompts generated together in one engine call
    max_in_flight: int = 0  # > 0: stream this many groups (single-turn); 0: batches
    weight_update: str = "continue"  # streaming: continue, finish or restart running samples
    max_staleness: int = 1  # same bound as the trainer's
    groups_per_step: int = 32  # the trainer's groups per optimizer step (for admission)
    heartbeat_s: float = 2.0
    seed: int = 0
    base_model: str = ""  # versions for another base are rejected ("": the daemon's model_dir)
    weights: FollowConfig = field(default_factory=FollowConfig)  # weight store and trainer key

    def __post_init__(self) -> None:
        for name in ("prompts_per_batch", "groups_per_step"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_staleness < 0:
            raise ConfigError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.max_in_flight < 0:
            raise ConfigError(f"max_in_flight must be >= 0, got {self.max_in_flight}")
        if self.weight_update not in WEIGHT_UPDATES:
            raise ConfigError(f"weight_update must be one of {', '.join(WEIGHT_UPDATES)}, got "
                              f"{self.weight_update!r}")

    def check_streaming(self, engine: str, env: str) -> None:
        """ConfigError when streaming (`max_in_flight` > 0) is asked of what cannot stream."""
        if not self.max_in_flight:
            return
        if engine not in STREAMING_ENGINES or env:
            raise ConfigError(f"rollout.max_in_flight streams single-turn groups on the "
                              f"{' or '.join(STREAMING_ENGINES)} engines (got engine {engine!r}"
                              f"{f', env {env!r}' if env else ''}); set it to 0 (episodes "
                              f"stream turns with episodes.stream_turns)")
        if self.weight_update == "continue" and engine != "hf":
            raise ConfigError(f"engine {engine!r} cannot continue a running request under new "
                              f"weights (that needs the hf engine's continuous batcher); set "
                              f"rollout.weight_update=finish (running requests end on the "
                              f"weights they started with, new ones use the new version) or "
                              f"restart")


def timed(fn, *args) -> float:
    """Seconds `fn(*args)` takes; run in the engine thread, the wait for the thread is not
    counted (it is generation, already in `producer/generate_s`)."""
    began = time.perf_counter()
    fn(*args)
    return time.perf_counter() - began


class RolloutWorker:
    def __init__(self, bus: Bus, engine: RolloutEngine, scorer: Scorer, config: RolloutConfig, *,
                 env: EnvironmentFactory | None = None,
                 episodes: EpisodeSettings | None = None, trackers: Trackers | None = None):
        self.bus = bus
        self.trackers = trackers or Trackers()  # opened and closed by the caller
        self._beats = 0  # heartbeats sent: the trackers' x axis
        self.engine = engine
        self.scorer = scorer
        self.config = config
        self.env = env
        self.trainer = TrainerView()
        self.paused = False
        self.counts: dict[str, float] = {"producer/groups": 0, "producer/tokens": 0,
                                         "producer/generate_s": 0.0, "producer/other_s": 0.0,
                                         "producer/load_s": 0.0, "producer/engine_errors": 0,
                                         "producer/weight_loads": 0, "producer/weight_errors": 0,
                                         "producer/bad_prompts": 0,
                                         "producer/rejected_prompts": 0,
                                         "producer/unverified": 0}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        shared = (engine, config.sampling, config.producer_id, self.counts)
        self.groups = (SingleTurnGroups(*shared, scorer=scorer, in_engine=self._in_engine)
                       if env is None else
                       EpisodeGroups(*shared, factory=env, settings=episodes or EpisodeSettings(),
                                     in_engine=self._in_engine))
        self.follower = WeightFollower(config.weights, base_model=config.base_model,
                                       counts=self.counts, apply=self._apply,
                                       reject=self._reject)
        self.stream = None  # streaming: the groups in generation (GroupStream, RequestStream)
        if config.max_in_flight:
            config.check_streaming(engine.name, "an environment" if env is not None else "")
            shared = (self.groups, self._in_engine, config.weight_update, config.seed,
                      self._engine_error)
            self.stream = (
                GroupStream(*shared) if hasattr(engine, "streaming_sampler") else
                AsyncRequestStream(*shared) if hasattr(engine, "streaming_requests") else
                RequestStream(*shared, max_in_flight=config.max_in_flight))
        # prompts whose groups are published, to commit
        self.commits = StreamOffsets() if self.stream else DoneOffsets()
        self.waiting: str | None = None  # what admission waits for (None: it admits)
        self._waiting_since = time.monotonic()
        self._sequence = 0
        self._in_flight = 0
        self._started, self._started_at = time.monotonic(), time.time()  # engine built

    def _topic(self, kind: str) -> str:
        return topic_name(self.config.run, kind)

    async def run(self, stop: asyncio.Event) -> None:
        drain = asyncio.Event()
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self._control_loop(stop, drain))
                tasks.create_task(self._status_loop(stop))
                tasks.create_task(self._heartbeat_loop(stop))
                await self._generation_loop(stop, drain)
                stop.set()
        finally:
            if self.stream is not None:
                self.stream.close()
            self._executor.shutdown(wait=True)

    async def _in_engine(self, fn, *args, **kwargs):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    # -- generation ---------------------------------------------------------------------------

    async def _generation_loop(self, stop: asyncio.Event, drain: asyncio.Event) -> None:
        consumer = self.bus.consumer([self._topic("prompts")],
                                     group_id=f"miles.{self.config.run}.producers",
                                     on_assigned=self.commits.on_assigned,
                                     on_revoked=self.commits.on_revoked)
        self.commits.consumer = consumer
        async with consumer:
            prompts = DecodingConsumer(self.bus, consumer, dlq_topic=self._topic("dlq"),
                                       expected=PromptTask,
                                       name=self.config.producer_id)
            trajectories = await self._trajectory_partitions()
            if self.stream is not None:
                await self._stream_loop(stop, drain, consumer, prompts, trajectories)
                return
            while not stop.is_set() and not drain.is_set():
                if not await self._admit(stop, consumer, trajectories):
                    continue
                batch = await prompts.poll(max_records=self.config.prompts_per_batch,
                                           timeout_s=0.2)
                if self.commits.revoking:  # these positions restart from the group's commit
                    await wait_or_stop(stop, ADMISSION_POLL_S)
                    continue
                await self._batch(consumer, prompts, batch, stop)

    async def _stream_loop(self, stop: asyncio.Event, drain: asyncio.Event, consumer,
                           prompts: DecodingConsumer, trajectories) -> None:
        """Keep up to `max_in_flight` groups in generation, as many as admission allows;
        publish and commit each as it ends. On stop or drain the groups in flight get `STOP_WAIT_S` to
        finish; those still running then are cancelled, their prompts left uncommitted."""
        finished = asyncio.Event()
        groups: set[asyncio.Task] = set()
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self.stream.run(finished))
                while not stop.is_set() and not drain.is_set():
                    await self.commits.commit()
                    room = await self._stream_room(stop, consumer, trajectories, len(groups))
                    if not room:
                        await wait_or_stop(stop, ADMISSION_POLL_S)
                        continue
                    polled = await prompts.poll(max_records=room, timeout_s=0.05)
                    if self.commits.revoking:  # these positions restart from the group's commit
                        continue
                    for item, ids in await self._takeable(prompts, polled):
                        ticket = self.commits.take(item.record)
                        group = tasks.create_task(self._stream_group(prompts, item, ids,
                                                                     ticket))
                        groups.add(group)
                        group.add_done_callback(groups.discard)
                    self.commits.polled(prompts.polled)
                await self._let_finish(groups)
                finished.set()
        except BaseException:
            self.commits.abandon()  # a revocation on the way out must not wait for the groups
            raise
        await self.commits.commit()

    async def _let_finish(self, groups: set[asyncio.Task]) -> None:
        """Give the groups in flight `STOP_WAIT_S` to finish, then cancel the rest (their prompts
        stay uncommitted: generated again by the partition's next owner)."""
        if groups:
            log.info("stopping: %d groups in flight get %g s to finish", len(groups),
                     STOP_WAIT_S)
            await asyncio.wait(set(groups), timeout=STOP_WAIT_S)
        if groups:
            log.warning("stopping: %d groups did not finish in %g s; their prompts will be "
                        "generated again", len(groups), STOP_WAIT_S)
            for group in list(groups):
                group.cancel()
            await asyncio.wait(set(groups))
            self.commits.abandon()

    async def _stream_room(self, stop: asyncio.Event, consumer, trajectories,
                           in_flight: int) -> int:
        """How many more groups may start now: the free slots, as many as are each still fresh
        enough when trained after those published and those in flight."""
        free = self.config.max_in_flight - in_flight
        if free <= 0 or self.stream.holding or self.commits.revoking or \
                await self._paused(stop):
            return 0
        queued = await self._published(consumer, trajectories) + in_flight - self.trainer.consumed
        bound = {"trainer": self.trainer, "groups_per_step": self.config.groups_per_step,
                 "max_staleness": self.config.max_staleness}
        self._wait_for(required_version(in_flight=queued, batch=1, **bound))
        return admissible(loaded_version=self.engine.policy_version, in_flight=queued,
                          most=free, **bound)

    async def _stream_group(self, prompts: DecodingConsumer, item: Decoded, ids: list[int],
                            ticket) -> None:
        """Generate, score and publish one prompt's group (or dead-letter a prompt the engine
        refuses), then mark its record done."""
        self._sequence += 1
        try:
            group = await self.stream.group(item.value, ids, self._sequence)
        except EngineRejectedError as err:
            await self._reject_prompt(prompts, item, str(err))
            self.commits.finish(ticket)
            return
        began = time.perf_counter()
        await (await self.bus.send(self._topic("trajectories"), encode(group),
                                   key=group.task_id.encode()))
        self.counts["producer/groups"] += 1
        self.counts["producer/tokens"] += sum(s.policy_tokens for s in group.samples)
        self.counts["producer/generate_s"] = self.stream.busy_s
        # its scoring (`reward_s`), encoding and publishing: overlaps other groups' generation
        self.counts["producer/other_s"] += group.timings["reward_s"] + (time.perf_counter()
                                                                        - began)
        self.commits.finish(ticket)

    async def _batch(self, consumer, prompts: DecodingConsumer, batch, stop: asyncio.Event) -> None:
        """Generate and publish one polled batch, then commit it (`DoneOffsets`: a revocation
        meanwhile waits for it; a commit refused after a rebalance is counted)."""
        self.commits.begin()
        try:
            tasks = await self._takeable(prompts, batch)
            if tasks:
                await self._roll_out(prompts, tasks)
            self.commits.done(prompts.polled)
        except EngineError as err:
            self.commits.abandon()
            await self._retry_later(consumer, batch, err, stop)
            return
        finally:
            self.commits.abandon()  # a no-op after `done`; a crash must not block a revocation
        await self.commits.commit()

    async def _takeable(self, prompts: DecodingConsumer,
                        batch: list[Decoded]) -> list[tuple[Decoded, list[int]]]:
        """Each prompt of `batch` with its token ids, except those no engine of this vocabulary
        can take (empty, ids outside it): bad data, not an engine failure, so they are
        dead-lettered (and committed past with the batch) instead of retried."""
        takeable = []
        for item in batch:
            try:
                ids = prompt_ids(self.engine, item.value)
            except EpisodeError as err:  # a malformed conversation, or one that cannot render
                self.counts["producer/bad_prompts"] += 1
                await prompts.dead_letter(item.record, f"metadata.messages: {err}", "messages")
                continue
            problem = prompt_problem(ids, self.engine.vocab_size)
            if problem is None:
                takeable.append((item, ids))
                continue
            self.counts["producer/bad_prompts"] += 1
            await prompts.dead_letter(item.record, f"prompt_token_ids: prompt {problem} of "
                                      f"engine {self.engine.name}", "prompt_token_ids")
        return takeable

    async def _reject_prompt(self, prompts: DecodingConsumer, item: Decoded, why: str) -> None:
        """Dead-letter a prompt this engine cannot take for what it asks (generating it again
        would fail again), counted; it is committed past like a published one."""
        self.counts["producer/rejected_prompts"] += 1
        await prompts.dead_letter(item.record, rejected_prompt_reason(why), "rejected_prompt")

    async def _retry_later(self, consumer, batch, err: EngineError, stop: asyncio.Event) -> None:
        """The engine failed on a batch (a server restart, a timeout): its prompts are not
        committed; rewind to them and try again after a pause. Generation goes on."""
        self._in_flight = 0
        log.error("generation failed, retrying the batch in %g s: %s", ENGINE_RETRY_S, err)
        await self._engine_error(f"generation failed: {err}")
        for tp in {d.record.tp for d in batch}:
            consumer.seek(tp, min(d.record.offset for d in batch if d.record.tp == tp))
        await wait_or_stop(stop, ENGINE_RETRY_S)

    async def _engine_error(self, error: str) -> None:
        self.counts["producer/engine_errors"] += 1
        await self._heartbeat(error=error)

    async def _trajectory_partitions(self) -> list[TopicPartition]:
        topic = self._topic("trajectories")
        info = (await self.bus.describe_topics([topic]))[topic]
        return [TopicPartition(topic, p) for p in range(info.partitions)]

    async def _paused(self, stop: asyncio.Event) -> bool:
        if self.paused:
            await wait_or_stop(stop, ADMISSION_POLL_S * 10)
        return self.paused

    async def _published(self, consumer, partitions) -> int:
        """Trajectory records on the bus (end offsets summed)."""
        return sum((await consumer.end_offsets(partitions)).values())

    async def _admit(self, stop: asyncio.Event, consumer, partitions) -> bool:
        """Whether a batch generated now is fresh enough when trained."""
        if await self._paused(stop):
            return False
        published = await self._published(consumer, partitions)
        needed = required_version(trainer=self.trainer, in_flight=published - self.trainer.consumed,
                                  batch=self.config.prompts_per_batch,
                                  groups_per_step=self.config.groups_per_step,
                                  max_staleness=self.config.max_staleness)
        self._wait_for(needed)
        if self.waiting is not None:
            await wait_or_stop(stop, ADMISSION_POLL_S)
        return self.waiting is None

    def _wait_for(self, needed: int) -> None:
        """Set `waiting` (reported in every heartbeat; logged every `WAIT_WARN_S` while it
        lasts): what admission waits for, and which newer versions failed to load."""
        loaded = self.engine.policy_version
        waiting = None
        if loaded < needed:
            waiting = f"policy version >= {needed} (loaded {loaded})"
            failures = self.follower.failures()
            if failures:
                waiting += f"; {failures}"
        now = time.monotonic()
        if waiting is None or self.waiting is None:
            self._waiting_since = now  # short waits are the normal rhythm of an async run
        elif now - self._waiting_since >= WAIT_WARN_S:
            log.warning("admission has waited %.0f s for %s", now - self._waiting_since, waiting)
            self._waiting_since = now
        self.waiting = waiting

    async def _roll_out(self, prompts: DecodingConsumer,
                        items: list[tuple[Decoded, list[int]]]) -> None:
        """Generate the groups of `items`, publish them, and dead-letter the batch's refused
        prompts and failed episodes (`rollout_groups.FailedEpisode`) as letters about their
        prompts."""
        began = time.perf_counter()
        self._in_flight = len(items)
        self._sequence += 1
        batch = [(item.value, ids) for item, ids in items]
        groups = await self.groups.groups(batch, self.config.seed * 1_000_003 + self._sequence,
                                          self._sequence)
        pending = [await self.bus.send(self._topic("trajectories"), encode(g),
                                       key=g.task_id.encode()) for g in groups]
        for delivery in pending:
            await delivery
        for rejected in self.groups.rejected:
            await self._reject_prompt(prompts, items[rejected.index][0], rejected.why)
        for failed in self.groups.failed:
            await prompts.dead_letter(items[failed.index][0].record, failed.reason,
                                      f"episode/{failed.kind}", part=failed.part,
                                      payload=failed.payload)
        self._in_flight = 0
        self.counts["producer/groups"] += len(groups)
        self.counts["producer/tokens"] += sum(s.policy_tokens for g in groups for s in g.samples)
        self.counts["producer/generate_s"] += self.groups.generate_s
        self.counts["producer/other_s"] += time.perf_counter() - began - self.groups.generate_s

    # -- control ------------------------------------------------------------------------------

    async def _control_loop(self, stop: asyncio.Event, drain: asyncio.Event) -> None:
        topic = self._topic("control")
        consumer = self.bus.consumer([topic], group_id=f"miles.{self.config.run}."
                                                       f"{self.config.producer_id}.control")
        async with consumer:
            control = DecodingConsumer(self.bus, consumer, dlq_topic=self._topic("dlq"),
                                       expected=(WeightVersion, Command),
                                       name=self.config.producer_id)
            while not stop.is_set():
                for item in await control.poll(timeout_s=0.2):
                    await self._on_control(item.value, stop, drain)
                if self.follower.load_due():
                    loaded = await self.follower.load_newest()
                    if loaded is not None:
                        self.trainer.follow(loaded.trainer_generation, loaded.policy_version)

    async def _on_control(self, value, stop: asyncio.Event, drain: asyncio.Event) -> None:
        if isinstance(value, WeightVersion):
            await self.follower.offer(value)
            return
        if value.target not in (ALL_TARGETS, self.config.producer_id):
            return
        if self.follower.unverified(value, f"command {value.command}"):
            return
        log.info("command %s (%s)", value.command, value.reason)
        if value.command in ("pause", "resume"):
            self.paused = value.command == "pause"
        elif value.command == "drain":
            drain.set()
        elif value.command == "stop":
            stop.set()

    async def _reject(self, version: WeightVersion, why: str) -> None:
        """Count, log and report (status event) a version this producer does not load; it
        keeps generating with the weights it has."""
        self.counts["producer/weight_errors"] += 1
        log.error("keeping version %d: version %d rejected: %s", self.engine.policy_version,
                  version.policy_version, why)
        await self._heartbeat(error=f"version {version.policy_version}: {why}")

    async def _apply(self, folder: Path, version: WeightVersion, new_lineage: bool) -> float:
        """Load a fetched version into the engine, in its thread (streaming: under the
        weight-update policy); the seconds it took there."""
        load = functools.partial(timed, functools.partial(
            self.engine.load_version, new_lineage=new_lineage), folder, version.policy_version,
            version.format)
        if self.stream is not None:
            return await self.stream.load(load, version.policy_version, version.created_at)
        return await self._in_engine(load)

    # -- status -------------------------------------------------------------------------------

    async def _status_loop(self, stop: asyncio.Event) -> None:
        consumer = self.bus.consumer([self._topic("status")], from_beginning=False,
                                     group_id=f"miles.{self.config.run}."
                                              f"{self.config.producer_id}.status")
        async with consumer:
            status = DecodingConsumer(self.bus, consumer, dlq_topic=self._topic("dlq"),
                                      expected=Heartbeat,
                                      name=self.config.producer_id)
            while not stop.is_set():
                for item in await status.poll(timeout_s=0.2):
                    beat = item.value
                    if beat.role == "trainer":
                        self._on_trainer_beat(beat)

    def _on_trainer_beat(self, beat: Heartbeat) -> None:
        """An unverified or fenced trainer's heartbeat is ignored; a newer generation's resets
        the view."""
        what = (f"trainer heartbeat (generation {beat.trainer_generation}, "
                f"version {beat.policy_version})")
        if self.follower.unverified(beat, what):
            return
        if self.trainer.follow(beat.trainer_generation, beat.policy_version):
            self.follower.announced.fence(beat.trainer_generation)
            self.trainer.consumed = int(beat.extra.get("consumed", 0))

    async def _heartbeat_loop(self, stop: asyncio.Event) -> None:
        """One heartbeat at once (the engine is built: a run's clock can start), then one every
        `heartbeat_s`."""
        await self._heartbeat()
        while not await wait_or_stop(stop, self.config.heartbeat_s):
            await self._heartbeat()

    async def _heartbeat(self, error: str | None = None) -> None:
        elapsed = max(time.monotonic() - self._started, 1e-9)
        extra = {"groups": int(self.counts["producer/groups"]),
                 "tokens": int(self.counts["producer/tokens"]),
                 "weight_errors": int(self.counts["producer/weight_errors"]),
                 "unverified": int(self.counts["producer/unverified"]),
                 "bad_prompts": int(self.counts["producer/bad_prompts"]),
                 "rejected_prompts": int(self.counts["producer/rejected_prompts"]),
                 "commit_failures": self.commits.failures,
                 "paused": self.paused,
                 "generate_s": round(self.counts["producer/generate_s"], 3),
                 "other_s": round(self.counts["producer/other_s"], 3),
                 "load_s": round(self.counts["producer/load_s"], 3),
                 "started_at": self._started_at}
        if self.env is not None:
            extra.update(episode_extras(self.counts))
        if self.stream is not None:
            extra.update(self.stream.extras())
        if self.waiting is not None:
            extra["waiting"] = self.waiting
        if self.follower.load_latencies:
            extra["load_latency_p50_s"] = round(self.follower.load_latency_p50(), 4)
        if error:
            extra["error"] = error
        beat = Heartbeat(producer_id=self.config.producer_id, role="producer",
                         engine=self.engine.name, policy_version=self.engine.policy_version,
                         in_flight=self._in_flight if self.stream is None
                         else self.stream.in_flight,
                         tokens_per_s=self.counts["producer/tokens"] / elapsed,
                         extra=extra, created_at=time.time())
        await self.bus.publish(self._topic("status"), encode(beat),
                               key=self.config.producer_id.encode())
        self._beats += 1
        self.trackers.log({**self.counts, "producer/tokens_per_s": beat.tokens_per_s,
                           "producer/policy_version": beat.policy_version,
                           "producer/in_flight": beat.in_flight,
                           "producer/commit_failures": self.commits.failures}, self._beats)


def episode_extras(counts: dict[str, float]) -> dict[str, int | float]:
    """The heartbeat's episode counters: episodes, turns, tool calls and errors, environment
    seconds and the producer's own seconds on episodes (totals, and per episode as
    `env_s_per_episode`, `work_s_per_episode`), failed episodes (and `failed_<kind>` by
    reason), truncated ones, empty groups."""
    out: dict[str, int | float] = {name: round(counts[f"producer/{name}"], 3)
                                   if name.endswith("_s") else int(counts[f"producer/{name}"])
                                   for name in EPISODE_COUNTERS}
    episodes = max(counts["producer/episodes"], 1)
    out["env_s_per_episode"] = round(counts["producer/env_s"] / episodes, 4)
    out["work_s_per_episode"] = round(counts["producer/work_s"] / episodes, 4)
    out.update({f"failed_{key.removeprefix('producer/failed/')}": int(value)
                for key, value in counts.items() if key.startswith("producer/failed/")})
    return out
