"""The trainer loop: trajectory groups in, weight versions out, checkpoints on the way.

Rank 0 talks to the bus; every rank trains. Each step rank 0 collects `groups_per_step` groups
whose lag is within `max_staleness` (staler ones are dropped and counted; they stay in the log;
with DAPO's dynamic sampling, groups whose rewards are all equal are filtered the same way and
the shortfall is read from the stream),
ships their wire bytes to the other ranks (`broadcast_bytes`, no pickle), all ranks run the
learner's step in a worker thread (the event loop keeps Kafka heartbeats alive), then rank 0
writes the new adapter to the weight store and announces it on the control topic, reports
progress on the status topic, appends the step to `ledger.jsonl` and `metrics.jsonl`, and
every `checkpoint_every` steps writes a checkpoint.

Re-generated prompts: a producer that dies after publishing but before committing its prompts
has them re-delivered to another producer, which generates them again. A group whose prompt
(task id, epoch) is among the last `RECENT_PROMPTS` seen counts as `trainer/regenerated_groups`
and is trained like any other (it is fresh data, just a second draw for the same prompt).

Exactly-once bookkeeping: per partition, the next offset to read is the offset of the first
group still waiting in the buffer, or the consumer's position when nothing waits; everything
before it was trained, dropped as stale or dead-lettered. A restarted trainer loads the newest
checkpoint, truncates the ledger to it and seeks there. The same offsets are committed to the
trainer's consumer group after every checkpoint and at shutdown, so its lag (`miles status`)
follows the run; the checkpoint, not the commit, is what a restart resumes from.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter, OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import msgpack

from miles.bus import Bus, TopicPartition
from miles.bus.decoding import Decoded, DecodingConsumer
from miles.errors import ConfigError
from miles.protocol import Heartbeat, TrajectoryGroup, WeightVersion, decode, encode
from miles.protocol.topics import topic_name
from miles.trainer import distributed
from miles.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from miles.trainer.learner import Learner
from miles.trainer.progress import Progress
from miles.weights.store import prune_versions, write_version

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

    def __post_init__(self) -> None:
        if self.groups_per_step < 1:
            raise ConfigError(f"groups_per_step must be >= 1, got {self.groups_per_step}")
        for name in ("max_staleness", "max_steps", "checkpoint_every", "keep_versions"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")


def uniform_rewards(group: TrajectoryGroup) -> bool:
    """All samples of `group` got the same reward (no learning signal for group baselines)."""
    return len({s.reward for s in group.samples}) <= 1


def pack_step(groups: list[bytes], *, checkpoint: bool, meta: dict) -> bytes:
    return msgpack.packb({"groups": groups, "checkpoint": checkpoint, "meta": meta},
                         use_bin_type=True)


def unpack_step(payload: bytes) -> tuple[list[TrajectoryGroup], bool, dict]:
    message = msgpack.unpackb(payload, raw=False)
    groups = [decode(raw, TrajectoryGroup) for raw in message["groups"]]
    return groups, message["checkpoint"], message["meta"]


class StepRunner:
    """What every rank does, in the same order on all of them (each call is a collective):
    resume from the newest checkpoint, train a step, export its weights, checkpoint."""

    def __init__(self, learner: Learner, config: LoopConfig, *, base_model: str):
        self.learner = learner
        self.config = config
        self.base_model = base_model
        self.weights_dir = Path(config.out_dir) / "weights"
        self.checkpoints = Path(config.out_dir) / "checkpoints"

    def resume(self) -> tuple[dict | None, WeightVersion | None]:
        """Load the newest checkpoint if any; export the weights the trainer starts from."""
        meta = None
        path = latest_checkpoint(self.checkpoints)
        if path is not None:
            state = self.learner.state_dict()
            meta = load_checkpoint(path, state)
            self.learner.load_state_dict(state)
        return meta, self.export(step=int(meta["step"]) if meta else 0)

    def export(self, *, step: int) -> WeightVersion | None:
        """Write the current weights to the store; rank 0 gets the record to announce."""
        if not distributed.is_main():
            self.learner.export_weights(self.weights_dir)  # the gather is collective
            return None
        record = write_version(self.weights_dir, policy_version=self.learner.policy_version,
                               step=step, base_model=self.base_model,
                               write=self.learner.export_weights, fmt=self.learner.weights_format)
        prune_versions(self.weights_dir, self.config.keep_versions)
        return record

    def step(self, payload: bytes) -> tuple[dict[str, float], WeightVersion | None] | None:
        """Run one step message broadcast by rank 0; None when the message says stop."""
        payload = distributed.broadcast_bytes(payload if distributed.is_main() else None)
        if not payload:
            return None
        groups, checkpoint, meta = unpack_step(payload)
        metrics, record = {}, None
        if groups:
            version = self.learner.policy_version
            metrics = self.learner.train_step(groups)
            if self.learner.policy_version != version:
                record = self.export(step=meta["step"])
        if checkpoint:
            save_checkpoint(self.checkpoints, meta["step"], self.learner.state_dict(), meta)
        return metrics, record

    def follow(self) -> None:
        """Ranks other than 0: resume, then run steps until rank 0 broadcasts stop."""
        self.resume()
        while self.step(b"") is not None:
            pass


class TrainerLoop:
    """Rank 0's side: the bus, staleness, weight versions, ledger, metrics, checkpoints."""

    def __init__(self, bus: Bus, runner: StepRunner):
        self.bus = bus
        self.runner = runner
        self.learner = runner.learner
        self.config = runner.config
        self.out_dir = Path(self.config.out_dir)
        self.buffer: deque[Decoded] = deque()
        self.step = 0
        self.counts: Counter[str] = Counter()
        self.lags: Counter[int] = Counter()
        self.recent_prompts: OrderedDict[tuple[str, int], None] = OrderedDict()
        self.progress = Progress()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="learner")

    def _topic(self, kind: str) -> str:
        return topic_name(self.config.run, kind)

    async def _blocking(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def run(self, stop: asyncio.Event) -> dict:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        consumer = self.bus.consumer([self._topic("trajectories")],
                                     group_id=f"miles.{self.config.run}.trainer")
        try:
            async with consumer:
                reader = DecodingConsumer(self.bus, consumer, dlq_topic=self._topic("dlq"),
                                          expected=TrajectoryGroup)
                offsets = await self._resume(consumer)
                while not stop.is_set() and not self._done():
                    groups, skipped = await self._collect(reader, consumer, stop)
                    if groups is None:
                        break
                    offsets = await self._train(groups, skipped, consumer, offsets)
                await self._finish(consumer, offsets)
        finally:
            await self._blocking(self.runner.step, b"")  # followers stop
            self._executor.shutdown(wait=True)
            self.progress.close()
        return {"steps": self.step, "policy_version": self.learner.policy_version,
                **self.counts, "lag_histogram": dict(sorted(self.lags.items()))}

    def _done(self) -> bool:
        return bool(self.config.max_steps) and self.step >= self.config.max_steps

    # -- resume -------------------------------------------------------------------------------

    async def _resume(self, consumer) -> dict[TopicPartition, int]:
        meta, record = await self._blocking(self.runner.resume)
        await self._announce(record)
        await self._wait_for_assignment(consumer)
        offsets: dict[TopicPartition, int] = {}
        if meta is None:
            return offsets
        self.step = int(meta["step"])
        for key, offset in meta["offsets"].items():
            topic, _, partition = key.rpartition(":")
            offsets[TopicPartition(topic, int(partition))] = int(offset)
        for tp, offset in offsets.items():
            if tp in consumer.assignment():
                consumer.seek(tp, offset)
        self._truncate_ledger(self.step)
        log.info("resumed at step %d, policy version %d", self.step, self.learner.policy_version)
        return offsets

    async def _wait_for_assignment(self, consumer) -> None:
        while not consumer.assignment():
            records = await consumer.poll(timeout_s=0.2)
            if records:  # a rebalance handed out partitions and data at once: rewind
                for tp in {r.tp for r in records}:
                    consumer.seek(tp, min(r.offset for r in records if r.tp == tp))

    def _truncate_ledger(self, step: int) -> None:
        path = self.out_dir / "ledger.jsonl"
        if not path.exists():
            return
        kept = [line for line in path.read_text().splitlines()
                if line and json.loads(line)["step"] <= step]
        path.write_text("".join(f"{line}\n" for line in kept))

    # -- collect ------------------------------------------------------------------------------

    async def _collect(self, reader: DecodingConsumer, consumer, stop: asyncio.Event):
        """`groups_per_step` fresh groups from the buffer and the bus, and the groups skipped on
        the way ({"dropped": stale, "filtered": equal rewards}); groups None if stopped first."""
        groups: list[Decoded] = []
        skipped: dict[str, list[Decoded]] = {"dropped": [], "filtered": []}
        last_beat = 0.0
        while len(groups) < self.config.groups_per_step:
            if not self.buffer:
                if stop.is_set():
                    self.buffer.extendleft(reversed(groups))
                    return None, skipped
                self.buffer.extend(await reader.poll(timeout_s=0.2))
                self.counts["trainer/dead_lettered"] = reader.counts["bus/dlq_records"]
                if time.monotonic() - last_beat > self.config.heartbeat_s:
                    await self._heartbeat(consumer)
                    last_beat = time.monotonic()
                continue
            item = self.buffer.popleft()
            self._note_prompt(item.value)
            lag = item.value.lag(self.learner.policy_version)
            if lag > self.config.max_staleness:
                skipped["dropped"].append(item)
            elif self.learner.algorithm.dynamic_sampling and uniform_rewards(item.value):
                skipped["filtered"].append(item)
            else:
                self.lags[lag] += 1
                groups.append(item)
        return groups, skipped

    def _note_prompt(self, group: TrajectoryGroup) -> None:
        key = (group.task_id, group.epoch)
        if key in self.recent_prompts:
            self.counts["trainer/regenerated_groups"] += 1
            return
        self.recent_prompts[key] = None
        if len(self.recent_prompts) > RECENT_PROMPTS:
            self.recent_prompts.popitem(last=False)

    # -- train --------------------------------------------------------------------------------

    async def _train(self, groups: list[Decoded], skipped: dict[str, list[Decoded]], consumer,
                     offsets: dict[TopicPartition, int]) -> dict[TopicPartition, int]:
        began = time.perf_counter()
        self.step += 1
        offsets = await self._next_offsets(consumer, offsets)
        checkpoint = bool(self.config.checkpoint_every) and \
            self.step % self.config.checkpoint_every == 0
        meta = {"step": self.step, "offsets": {f"{tp.topic}:{tp.partition}": o
                                               for tp, o in offsets.items()}}
        self._write_ledger(groups, skipped)
        payload = pack_step([g.record.value for g in groups], checkpoint=checkpoint, meta=meta)
        metrics, record = await self._blocking(self.runner.step, payload)
        if record is not None:
            await self._announce(record)
        if checkpoint:
            await self._commit(consumer, offsets)
        self.counts["trainer/groups_trained"] += len(groups)
        self.counts["trainer/dropped_stale"] += len(skipped["dropped"])
        self.counts["trainer/filtered_groups"] += len(skipped["filtered"])
        self._write_metrics(metrics, groups, time.perf_counter() - began)
        await self._heartbeat(consumer)
        return offsets

    async def _checkpoint(self, meta: dict) -> None:
        await self._blocking(self.runner.step, pack_step([], checkpoint=True, meta=meta))

    async def _next_offsets(self, consumer, offsets: dict[TopicPartition, int]
                            ) -> dict[TopicPartition, int]:
        """Per partition: the first offset not yet trained, dropped or dead-lettered."""
        waiting: dict[TopicPartition, int] = {}
        for item in self.buffer:
            waiting.setdefault(item.record.tp, item.record.offset)
        updated = dict(offsets)
        for tp in consumer.assignment():
            updated[tp] = waiting.get(tp, await consumer.position(tp))
        return updated

    async def _announce(self, record: WeightVersion) -> None:
        await self.bus.publish(self._topic("control"), encode(record), key=b"weights")

    async def _finish(self, consumer, offsets: dict[TopicPartition, int]) -> None:
        if self.step and (not self.config.checkpoint_every or
                          self.step % self.config.checkpoint_every):
            offsets = await self._next_offsets(consumer, offsets)
            await self._checkpoint({"step": self.step, "offsets": {
                f"{tp.topic}:{tp.partition}": o for tp, o in offsets.items()}})
        await self._commit(consumer, offsets)

    @staticmethod
    async def _commit(consumer, offsets: dict[TopicPartition, int]) -> None:
        """Commit `offsets` (those of the newest checkpoint) for the partitions still assigned."""
        mine = {tp: o for tp, o in offsets.items() if tp in consumer.assignment()}
        if mine:
            await consumer.commit(mine)

    # -- reporting ----------------------------------------------------------------------------

    def _write_ledger(self, groups: list[Decoded], skipped: dict[str, list[Decoded]]) -> None:
        entry = {"step": self.step, "policy_version": self.learner.policy_version,
                 "trained": [g.value.group_id for g in groups],
                 **{kind: [g.value.group_id for g in items] for kind, items in skipped.items()}}
        with open(self.out_dir / "ledger.jsonl", "a") as f:
            f.write(json.dumps(entry) + "\n")

    def _write_metrics(self, metrics: dict[str, float], groups: list[Decoded],
                       step_s: float) -> None:
        samples = [s for g in groups for s in g.value.samples]
        line = {"step": self.step, "time": time.time(), **metrics,
                "trainer/step_s": step_s,
                "trainer/tokens_per_s": metrics.get("trainer/tokens", 0.0) / max(step_s, 1e-9),
                "trainer/accuracy": sum(s.reward > 0 for s in samples) / max(len(samples), 1),
                "trainer/max_lag": max(self.lags) if self.lags else 0,
                "trainer/lag_histogram": {str(k): v for k, v in sorted(self.lags.items())},
                **{k: v for k, v in self.counts.items()}}
        with open(self.out_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
        self.progress.update(line)

    async def _heartbeat(self, consumer) -> None:
        positions = [await consumer.position(tp) for tp in consumer.assignment()]
        consumed = sum(positions) - len(self.buffer)
        extra = {"consumed": consumed, "step": self.step, **self.counts,
                 **{f"lag/{lag}": count for lag, count in self.lags.items()}}  # running totals
        beat = Heartbeat(producer_id=f"trainer-{self.config.run}", role="trainer",
                         engine="fsdp2", policy_version=self.learner.policy_version,
                         extra=extra, created_at=time.time())
        await self.bus.publish(self._topic("status"), encode(beat), key=b"trainer")

