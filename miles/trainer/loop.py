"""The trainer loop: trajectory groups in, weight versions out, checkpoints on the way.

Rank 0 talks to the bus; every rank trains. Each step rank 0 collects `groups_per_step` groups
whose lag is within `max_staleness` (staler ones are dropped and counted; they stay in the log;
with DAPO's dynamic sampling, groups whose rewards are all equal are filtered the same way and
the shortfall is read from the stream; groups this trainer cannot train, by the rules of
`miles.trainer.intake`, are dead-lettered with the reason as they are polled),
ships their wire bytes to the other ranks (`broadcast_bytes`, no pickle), all ranks run the
learner's step in a worker thread (the event loop keeps Kafka heartbeats alive; rank 0
meanwhile collects the next step's groups, judged against the version the running step will
make, so the next step starts as soon as this one ends), then rank 0
dead-letters the groups that made the step fail, appends the step to `ledger.jsonl` (only once
its update is done, listing only the groups in it), announces the new adapter it wrote to the
weight store on the control topic (each announcement and heartbeat signed with the run's
Ed25519 key, `miles.weights.signing`), every `checkpoint_every` steps has all ranks write a
checkpoint (a second step message, after the accounting it records), appends to
`metrics.jsonl` (and to the experiment trackers, `miles.trackers`; every `samples_every` steps
a table of trained samples to `samples.jsonl` and the trackers, `miles.trainer.sample_table`)
and reports progress on the status topic. What every rank runs (resume, step, export,
checkpoint) is `miles.trainer.runner.StepRunner`.

Failing steps: a step that is not finite or raises on its data changes nothing; every rank
bisects the batch the same way (`miles.trainer.isolation`) and trains the rest in one update;
the groups that fail come back to rank 0, which dead-letters them (`docs/delivery.md`).

Re-generated prompts: a producer that dies after publishing but before committing its prompts
has them re-delivered to another producer, which generates them again. A group whose prompt
(task id, epoch) is among the last `RECENT_PROMPTS` seen counts as `trainer/regenerated_groups`
and is trained like any other (it is fresh data, just a second draw for the same prompt).

Exactly-once bookkeeping: per partition, the next offset to read is the offset of the first
group still waiting (in the buffer or the step being collected), or past the last record polled
when nothing waits; everything before it was trained, dropped as stale or dead-lettered. The
trainer keeps these positions itself and seeks every partition the group assigns it to them
(rebalance callbacks), so pauses past the session timeout and members joining or leaving never
move it back to the group's committed offset. A restarted trainer takes the next generation
(`fence`: an older trainer still running stops at its next side effect), loads the newest
checkpoint that verifies, cuts the ledger, metrics and samples back to it (to nothing without
one), restores its counters and seeks there. The same offsets are committed to the trainer's consumer
group after every checkpoint and at shutdown, so its lag (`miles status`) follows the run; the
checkpoint, not the commit, is what a restart resumes from (`docs/delivery.md`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter, OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from miles.bus import Bus, TopicPartition
from miles.bus.decoding import Decoded, DecodingConsumer
from miles.errors import BusError, ConfigError
from miles.protocol import Heartbeat, TrajectoryGroup, WeightVersion, encode
from miles.protocol.topics import topic_name
from miles.trackers import Trackers
from miles.trainer.intake import IntakeConfig, TrainerLimits, check_group
from miles.trainer.progress import Progress
from miles.trainer.runner import StepRunner, pack_step
from miles.trainer.sample_table import sample_rows
from miles.weights.signing import Signer, trainer_signer

log = logging.getLogger(__name__)
RECENT_PROMPTS = 65_536  # prompts remembered to count re-generated ones


@dataclass(frozen=True, kw_only=True)
class LoopConfig:
    run: str = "demo"  # topics are miles.<run>.*
    out_dir: Path = Path("runs/demo")  # weights/, checkpoints/, metrics.jsonl, ledger.jsonl
    groups_per_step: int = 32  # trajectory groups per optimizer step (the global batch)
    max_staleness: int = 1  # groups with lag > this are dropped; 0 = strictly on-policy
    max_steps: int = 0  # stop after this many steps in total (0: run until stopped)
    checkpoint_every: int = 10  # steps between checkpoints (0: only at the end)
    keep_versions: int = 16  # newest weight versions kept in out_dir/weights (0: all)
    heartbeat_s: float = 1.0  # status-topic heartbeat period while waiting for data
    intake: IntakeConfig = field(default_factory=IntakeConfig)  # what groups are admitted
    signing_key: Path | None = None  # Ed25519 private key (PEM); None: out_dir/keys/control.key

    def __post_init__(self) -> None:
        if self.groups_per_step < 1:
            raise ConfigError(f"groups_per_step must be >= 1, got {self.groups_per_step}")
        for name in ("max_staleness", "max_steps", "checkpoint_every", "keep_versions"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")


def uniform_rewards(group: TrajectoryGroup) -> bool:
    """All samples of `group` got the same reward (no learning signal for group baselines)."""
    return len({s.reward for s in group.samples}) <= 1


def new_batch() -> dict[str, list[Decoded]]:
    """A step's groups by what became of them (the ledger's keys); `failed`: groups that made
    the step fail, dead-lettered (filled once the step ran)."""
    return {"trained": [], "dropped": [], "filtered": [], "failed": []}


def truncate_steps(path: Path, step: int) -> None:
    """Keep only the lines of a JSONL log (ledger, metrics) whose step is <= `step`."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines()
            if line and json.loads(line)["step"] <= step]
    path.write_text("".join(f"{line}\n" for line in kept))


class TrainerLoop:
    """Rank 0's side: the bus, staleness, weight versions, ledger, metrics, checkpoints.

    The trainer owns its positions: `positions` holds, per partition, the next offset to read
    as of the last step or rebalance (the checkpoint's at start). Whenever the group assigns
    partitions (the first join, or a rejoin after a pause longer than the session timeout, a
    member joining or leaving) each is sought to its position, never to the group's committed
    offset; records of revoked partitions that were read but not yet trained are discarded
    (they are read again from the position, by this trainer or the next owner)."""

    def __init__(self, bus: Bus, runner: StepRunner, trackers: Trackers | None = None):
        self.bus = bus
        self.trackers = trackers or Trackers()  # opened and closed by the caller
        self.runner = runner
        self.learner = runner.learner
        self.config = runner.config
        self.out_dir = Path(self.config.out_dir)
        self.buffer: deque[Decoded] = deque()
        self.batch: dict[str, list[Decoded]] = new_batch()  # the step being collected
        self.positions: dict[TopicPartition, int] = {}
        self.read_to: dict[TopicPartition, int] = {}  # past the last record polled, this process
        self._revoked_in_poll: set[TopicPartition] = set()  # by a rebalance inside a poll
        self._pending_version: int | None = None  # what the step in flight will make
        self.step = 0
        self.counts: Counter[str] = Counter()
        self.lags: Counter[int] = Counter()
        self.recent_prompts: OrderedDict[tuple[str, int], None] = OrderedDict()
        self.progress = Progress()
        self.consumer = None
        self.reader: DecodingConsumer | None = None
        self.signer: Signer | None = None  # signs versions and heartbeats (from `run`)
        self._dead_lettered_before = 0  # by earlier incarnations (from the checkpoint)
        self.limits = TrainerLimits.of(self.learner, self.config.intake)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="learner")

    def _topic(self, kind: str) -> str:
        return topic_name(self.config.run, kind)

    async def _blocking(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def run(self, stop: asyncio.Event) -> dict:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        stepping: asyncio.Task | None = None  # the step in flight (`_train`)
        try:
            self.signer = trainer_signer(self.out_dir, self.config.signing_key)
            await self._resume()
            self.consumer = self.bus.consumer(
                [self._topic("trajectories")], group_id=f"miles.{self.config.run}.trainer",
                on_assigned=self._on_assigned, on_revoked=self._on_revoked)
            async with self.consumer:
                self.reader = DecodingConsumer(self.bus, self.consumer,
                                               dlq_topic=self._topic("dlq"),
                                               expected=TrajectoryGroup, name="trainer")
                while not stop.is_set() and not self._done():
                    collected = await self._collect_beside(stepping, stop)
                    stepping = None
                    if not collected or stop.is_set():  # what was collected is read again
                        break
                    stepping = asyncio.create_task(self._train(self._begin_step()))
                if stepping is not None:
                    await stepping
                await self._finish()
        finally:
            if stepping is not None and not stepping.done():
                stepping.cancel()
                await asyncio.wait({stepping})
            await self._blocking(self.runner.step, b"")  # followers stop
            self._executor.shutdown(wait=True)
            self.progress.close()
        return {"steps": self.step, "policy_version": self.learner.policy_version,
                **self.counts, "lag_histogram": dict(sorted(self.lags.items()))}

    def _done(self) -> bool:
        return bool(self.config.max_steps) and self.step >= self.config.max_steps

    # -- resume and rebalances ----------------------------------------------------------------

    async def _resume(self) -> None:
        """Load the checkpoint, cut the ledger and metrics back to it (to nothing without one),
        restore the counters, announce the starting weights."""
        meta, record = await self._blocking(self.runner.resume)
        meta = meta or {"step": 0, "offsets": {}}
        self.step = int(meta["step"])
        for key, offset in meta["offsets"].items():
            topic, _, partition = key.rpartition(":")
            self.positions[TopicPartition(topic, int(partition))] = int(offset)
        self.counts.update(meta.get("counts", {}))
        self.lags.update({int(k): v for k, v in meta.get("lags", {}).items()})
        self._dead_lettered_before = self.counts["trainer/dead_lettered"]
        for name in ("ledger.jsonl", "metrics.jsonl", "samples.jsonl"):
            truncate_steps(self.out_dir / name, self.step)
        await self._announce(record)
        log.info("trainer generation %d %s at step %d, policy version %d",
                 self.runner.fence.generation, "resumed" if self.step else "started",
                 self.step, self.learner.policy_version)

    def _in_flight(self):
        yield from self.buffer
        for items in self.batch.values():
            yield from items

    def _position(self, tp: TopicPartition) -> int | None:
        """The first offset of `tp` not yet trained, dropped or dead-lettered."""
        waiting = [d.record.offset for d in self._in_flight() if d.record.tp == tp]
        return min(waiting) if waiting else self._polled_to(tp)

    def _polled_to(self, tp: TopicPartition) -> int | None:
        """The offset past the last record of `tp` polled (or the known position)."""
        return self.read_to.get(tp, self.positions.get(tp))

    async def _on_revoked(self, revoked: set[TopicPartition]) -> None:
        self._revoked_in_poll |= revoked
        for tp in revoked:
            position = self._position(tp)
            if position is not None:
                self.positions[tp] = position
            self.read_to.pop(tp, None)
        dropped = sum(d.record.tp in revoked for d in self._in_flight())
        # in place: `_collect` may hold a reference across the poll this callback runs in
        kept = [d for d in self.buffer if d.record.tp not in revoked]
        self.buffer.clear()
        self.buffer.extend(kept)
        for items in self.batch.values():
            items[:] = [d for d in items if d.record.tp not in revoked]
        log.info("partitions revoked: %s; %d groups read ahead will be read again",
                 sorted(f"{tp.topic}:{tp.partition}" for tp in revoked), dropped)

    async def _on_assigned(self, assigned: set[TopicPartition]) -> None:
        for tp in assigned:
            if tp in self.positions:
                self.consumer.seek(tp, self.positions[tp])

    # -- collect ------------------------------------------------------------------------------

    async def _collect_beside(self, stepping: asyncio.Task | None, stop: asyncio.Event) -> bool:
        """`_collect` while the step in flight (if any) runs; once both are done, whether the
        next batch was collected. A step that fails stops the collection and raises; a
        collection that fails leaves the step to `run`, which cancels it."""
        if stepping is None:
            return await self._collect(stop)
        collecting = asyncio.ensure_future(self._collect(stop))
        try:
            await asyncio.wait({collecting, stepping}, return_when=asyncio.FIRST_EXCEPTION)
            if stepping.done() and stepping.exception() is not None:
                await stepping  # raises
            collected = await collecting
            await stepping
            return collected
        finally:
            if not collecting.done():  # the step failed, or the loop was cancelled
                collecting.cancel()
                await asyncio.wait({collecting})

    def _judged_version(self) -> int:
        """The policy version groups are judged against: the learner's, or during a step the
        version that step will make (the batch being collected trains after it). A step that
        makes none (critic warm-up) leaves them judged one version stricter than needed."""
        if self._pending_version is not None:
            return self._pending_version
        return self.learner.policy_version

    async def _collect(self, stop: asyncio.Event) -> bool:
        """Fill `batch` with `groups_per_step` fresh groups from the buffer and the bus, and the
        groups skipped on the way (dropped: stale, filtered: equal rewards); False if stopped
        first (what was collected goes back to the buffer)."""
        last_beat = 0.0
        while len(self.batch["trained"]) < self.config.groups_per_step:
            if not self.buffer:
                if stop.is_set():
                    self.buffer.extendleft(reversed(self.batch["trained"]))
                    self.batch["trained"] = []
                    return False
                self._revoked_in_poll = set()
                items = await self.reader.poll(timeout_s=0.2)
                items, polled = self._fetched_since_rebalance(items)
                self.buffer.extend(await self._admitted(items))
                self.read_to.update(polled)
                self._count_dead_letters()
                # none during a step (its own follows it): the version it would report is the
                # one before the step, which the groups collected now come after
                if self._pending_version is None and \
                        time.monotonic() - last_beat > self.config.heartbeat_s:
                    self.runner.fence.check()  # an idle zombie must not hold partitions
                    await self._heartbeat()
                    last_beat = time.monotonic()
                continue
            item = self.buffer.popleft()
            if item.value.lag(self._judged_version()) > self.config.max_staleness:
                self.batch["dropped"].append(item)
            elif self.learner.algorithm.dynamic_sampling and uniform_rewards(item.value):
                self.batch["filtered"].append(item)
            else:
                self.batch["trained"].append(item)
        return True

    def _fetched_since_rebalance(self, items: list[Decoded]
                                 ) -> tuple[list[Decoded], dict[TopicPartition, int]]:
        """The poll's records and end offsets, less those of partitions a rebalance revoked while
        the poll ran (the decoding consumer yields between records, so the callbacks can run
        with records of the old assignment already fetched): the revocation sought each
        partition back to the trainer's position, from which they are read again; keeping them
        too would train them twice. A partition handed back during the poll is sought to that
        position once more (or, before any, to the first record dropped), since the consumer
        has moved past what it returned."""
        revoked, self._revoked_in_poll = self._revoked_in_poll, set()
        if not revoked:
            return items, self.reader.polled
        dropped = [d for d in items if d.record.tp in revoked]
        for tp in revoked & self.consumer.assignment():
            first = min((d.record.offset for d in dropped if d.record.tp == tp), default=None)
            position = self.positions.get(tp, first)  # none yet: where the dropped ones began
            if position is not None:
                self.positions[tp] = position
                self.consumer.seek(tp, position)
        polled = {tp: o for tp, o in self.reader.polled.items() if tp not in revoked}
        return [d for d in items if d.record.tp not in revoked], polled

    async def _admitted(self, items: list[Decoded]) -> list[Decoded]:
        """The groups of `items` this trainer can train (`miles.trainer.intake`); the others are
        dead-lettered with the reason and counted. Nothing waits on a rejected group, so its
        offset counts as consumed like a stale one's."""
        admitted = []
        for item in items:
            rejection = check_group(item.value, self.limits,
                                    policy_version=self.learner.policy_version)
            if rejection is None:
                admitted.append(item)
                continue
            await self.reader.dead_letter(item.record, str(rejection), rejection.field)
            self.counts["trainer/rejected_groups"] += 1
            self.counts[f"trainer/rejected/{rejection.rule}"] += 1
        return admitted

    def _note_prompt(self, group: TrajectoryGroup) -> None:
        key = (group.task_id, group.epoch)
        if key in self.recent_prompts:
            self.counts["trainer/regenerated_groups"] += 1
            return
        self.recent_prompts[key] = None
        if len(self.recent_prompts) > RECENT_PROMPTS:
            self.recent_prompts.popitem(last=False)

    # -- train --------------------------------------------------------------------------------

    def _begin_step(self) -> dict:
        """Take the collected batch for the next step (at once, before the next collection
        starts): count the step, note the positions after it and the version it will make."""
        batch, self.batch = self.batch, new_batch()
        self.step += 1
        self.positions = self._next_offsets()
        self._pending_version = self.learner.policy_version + 1
        return batch

    async def _train(self, batch: dict[str, list[Decoded]]) -> None:
        """Run the step, then account for it: dead-letter the groups that failed it, write its
        ledger line (only now: a step that crashes leaves none, and its groups are read again
        from the positions of the last checkpoint), announce, checkpoint, report."""
        began = time.perf_counter()
        version = self.learner.policy_version  # what the groups' lags were judged against
        self.runner.fence.check()
        payload = pack_step([g.record.value for g in batch["trained"]], checkpoint=False,
                            meta={"step": self.step})
        try:
            result = await self._blocking(self.runner.step, payload,
                                          [g.value for g in batch["trained"]])
        finally:
            self._pending_version = None
        await self._dead_letter_failed(batch, result.failed)
        self._count(batch, version)
        self.runner.fence.check()
        self._write_ledger(batch, version)
        if result.record is not None:
            await self._announce(result.record)
        if self.config.checkpoint_every and self.step % self.config.checkpoint_every == 0:
            await self._checkpoint()
            await self._commit()
        self._write_metrics(result.metrics, batch["trained"], time.perf_counter() - began)
        self._write_samples(batch["trained"], version)
        await self._heartbeat()

    async def _dead_letter_failed(self, batch: dict[str, list[Decoded]],
                                  failed: dict[int, str]) -> None:
        """Move the groups that failed the step from `trained` to `failed`, dead-lettered."""
        trained = batch["trained"]
        batch["trained"] = [g for i, g in enumerate(trained) if i not in failed]
        batch["failed"] = [trained[i] for i in sorted(failed)]
        for index in sorted(failed):
            await self.reader.dead_letter(trained[index].record,
                                          f"train step failed: {failed[index]}", "train_step")
        self._count_dead_letters()

    def _count_dead_letters(self) -> None:
        self.counts["trainer/dead_lettered"] = \
            self._dead_lettered_before + self.reader.counts["bus/dlq_records"]

    async def _checkpoint(self) -> None:
        """Every rank saves the checkpoint of the step just accounted for (a collective)."""
        self.runner.fence.check()
        await self._blocking(self.runner.step, pack_step([], checkpoint=True, meta=self._meta()))

    def _count(self, batch: dict[str, list[Decoded]], version: int) -> None:
        for item in (d for items in batch.values() for d in items):
            self._note_prompt(item.value)
        for item in batch["trained"]:
            self.lags[item.value.lag(version)] += 1
        self.counts["trainer/groups_trained"] += len(batch["trained"])
        self.counts["trainer/dropped_stale"] += len(batch["dropped"])
        self.counts["trainer/filtered_groups"] += len(batch["filtered"])
        self.counts["trainer/failed_groups"] += len(batch["failed"])

    def _meta(self) -> dict:
        """What a checkpoint of this step records besides the learner's state."""
        return {"step": self.step, "generation": self.runner.fence.generation,
                "offsets": {f"{tp.topic}:{tp.partition}": o for tp, o in self.positions.items()},
                "counts": dict(self.counts),
                "lags": {str(lag): count for lag, count in self.lags.items()},
                **self.learner.kl.checkpoint_meta()}

    def _next_offsets(self) -> dict[TopicPartition, int]:
        """Per partition: the first offset not yet trained, dropped or dead-lettered."""
        tps = set(self.positions) | self.consumer.assignment()
        return {tp: offset for tp in tps if (offset := self._position(tp)) is not None}

    async def _announce(self, record: WeightVersion) -> None:
        self.runner.fence.check()
        await self.bus.publish(self._topic("control"), encode(self.signer.sign(record)),
                               key=b"weights")

    async def _finish(self) -> None:
        if self.step and (not self.config.checkpoint_every or
                          self.step % self.config.checkpoint_every):
            self.positions = self._next_offsets()
            await self._checkpoint()
        await self._commit()

    async def _commit(self) -> None:
        """Commit `positions` (those of the newest checkpoint) for the partitions still assigned;
        for monitoring only, so a commit refused after a rebalance is logged, not fatal."""
        mine = {tp: o for tp, o in self.positions.items() if tp in self.consumer.assignment()}
        if not mine:
            return
        try:
            await self.consumer.commit(mine)
        except BusError as err:
            log.warning("offsets not committed (monitoring only; the checkpoint has them): %s",
                        err)

    # -- reporting ----------------------------------------------------------------------------

    def _write_ledger(self, batch: dict[str, list[Decoded]], version: int) -> None:
        """The step's line, written once its update is done: `policy_version` is the version
        its groups were judged against (before the update), `trained` the groups in it."""
        entry = {"step": self.step, "policy_version": version,
                 "generation": self.runner.fence.generation,
                 **{kind: [g.value.group_id for g in items] for kind, items in batch.items()}}
        with open(self.out_dir / "ledger.jsonl", "a") as f:
            f.write(json.dumps(entry) + "\n")

    def _write_metrics(self, metrics: dict[str, float], groups: list[Decoded],
                       step_s: float) -> None:
        samples = [s for g in groups for s in g.value.samples]
        line = {"step": self.step, "time": time.time(), **metrics,
                "trainer/step_s": step_s,
                "trainer/tokens_per_s": metrics.get("trainer/tokens", 0.0) / max(step_s, 1e-9),
                "trainer/accuracy": sum(s.reward > 0 for s in samples) / max(len(samples), 1),
                "trainer/episode_samples": sum(s.loss_mask is not None for s in samples),
                "trainer/max_lag": max(self.lags) if self.lags else 0,
                "trainer/lag_histogram": {str(k): v for k, v in sorted(self.lags.items())},
                **{k: v for k, v in self.counts.items()}}
        with open(self.out_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
        self.trackers.log({k: v for k, v in line.items() if k not in ("step", "time")}, self.step)
        self.progress.update(line)

    def _write_samples(self, groups: list[Decoded], version: int) -> None:
        """Every `samples_every` steps: a table of the step's trained samples (lags judged
        against `version`) appended to samples.jsonl, with or without trackers, and sent to
        each tracker."""
        if not groups or not self.trackers.samples_due(self.step):
            return
        rows = sample_rows([g.value for g in groups], self.learner.tokenizer,
                           self.learner.algorithm, step=self.step, policy_version=version,
                           limit=self.trackers.settings.samples_rows)
        with open(self.out_dir / "samples.jsonl", "a") as f:
            f.write("".join(json.dumps(row) + "\n" for row in rows))
        self.trackers.log_samples(rows, self.step)

    async def _heartbeat(self) -> None:
        tps = set(self.positions) | self.consumer.assignment()
        # records taken off the buffer count as consumed (admission: producers must not wait
        # on groups the step being collected has already judged), except a whole step's worth
        # collected during the step just done: producers' next groups train after it
        consumed = sum(self._polled_to(tp) or 0 for tp in tps) - len(self.buffer)
        if len(self.batch["trained"]) >= self.config.groups_per_step:
            consumed -= len(self.batch["trained"])
        extra = {"consumed": consumed, "step": self.step, **self.counts,
                 **{f"lag/{lag}": count for lag, count in self.lags.items()}}  # running totals
        beat = Heartbeat(producer_id=f"trainer-{self.config.run}", role="trainer",
                         engine="fsdp2", policy_version=self.learner.policy_version,
                         trainer_generation=self.runner.fence.generation, extra=extra, created_at=time.time())
        await self.bus.publish(self._topic("status"), encode(self.signer.sign(beat)),
                               key=b"trainer")

