"""In-process bus with Kafka's semantics, for single-process runs without a broker.

Simplifications, chosen because one process on one event loop is the only user:
- records live in memory for the life of the bus (no retention); `embedded://PATH` also keeps
  them and the groups' committed offsets in files under PATH (`miles.bus.embedded_log`), so a
  process that opens the same PATH after a kill reads on where the killed one left off;
- a group rebalances eagerly and at once when a member starts or closes: every member's
  partitions are revoked (its `on_revoked` awaited), then the new assignment is handed out
  (contiguous ranges of each topic's partitions over the members sorted by join order); a
  commit of a partition not assigned (any more) raises `CommitFailedError`, as on Kafka;
- keyed records go to `crc32(key) % partitions` (Kafka uses murmur2; both keep one key on one
  partition), unkeyed ones round-robin.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import zlib
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from pathlib import Path

from miles.bus.base import (Bus, Consumer, Delivery, Headers, RebalanceCallback, Record,
                            TopicInfo, TopicPartition, check_record_size)
from miles.bus.embedded_log import BusFiles
from miles.errors import BusError, CommitFailedError
from miles.protocol.topics import TopicSpec


class _Topic:
    def __init__(self, info: TopicInfo, partitions: list[list[Record]] | None = None):
        self.info = info
        self.partitions = partitions or [[] for _ in range(info.partitions)]
        self.round_robin = itertools.cycle(range(info.partitions))


class _Group:
    def __init__(self, committed: dict[TopicPartition, int] | None = None) -> None:
        self.members: list[EmbeddedConsumer] = []
        self.committed: dict[TopicPartition, int] = committed or {}
        self.lock = asyncio.Lock()

    async def rebalance(self, *, joining: EmbeddedConsumer | None = None,
                        leaving: EmbeddedConsumer | None = None) -> None:
        async with self.lock:
            for member in self.members:
                await member._revoke_all()
            if joining is not None:
                self.members.append(joining)
            if leaving is not None:
                self.members.remove(leaving)
            for member, tps in self._assign().items():
                await member._assign(tps)

    def _assign(self) -> dict[EmbeddedConsumer, set[TopicPartition]]:
        plan: dict[EmbeddedConsumer, set[TopicPartition]] = {m: set() for m in self.members}
        topics = sorted({t for m in self.members for t in m.topics})
        for topic in topics:
            members = [m for m in self.members if topic in m.topics]
            count = members[0].bus._topic(topic).info.partitions
            for index, member in enumerate(members):
                start, stop = index * count // len(members), (index + 1) * count // len(members)
                plan[member].update(TopicPartition(topic, p) for p in range(start, stop))
        return plan


class EmbeddedBus(Bus):
    """In memory, or durable in the folder `path` (read back when the bus starts)."""

    def __init__(self, path: str | Path | None = None) -> None:
        self._files = BusFiles(Path(path)) if path else None
        self.url = f"embedded://{path}" if path else "embedded://"
        self._topics: dict[str, _Topic] = {}
        self._groups: dict[str, _Group] = {}
        self._new_data = asyncio.Event()
        self._closed = False

    async def start(self) -> None:
        self._closed = False
        if self._files is not None and not self._topics:
            self._topics = {name: _Topic(info, partitions)
                            for name, (info, partitions) in self._files.topics().items()}
            self._groups = {group_id: _Group(committed)
                            for group_id, committed in self._files.groups().items()}

    async def close(self) -> None:
        self._closed = True
        self._wake_consumers()
        if self._files is not None:
            self._files.close()

    async def create_topics(self, specs: Iterable[TopicSpec]) -> list[str]:
        created = []
        for spec in specs:
            if spec.name not in self._topics:
                info = TopicInfo(name=spec.name, partitions=spec.partitions,
                                 configs=dict(spec.configs))
                if self._files is not None:
                    self._files.add_topic(info)
                self._topics[spec.name] = _Topic(info)
                created.append(spec.name)
        return created

    async def describe_topics(self, names: Iterable[str]) -> dict[str, TopicInfo]:
        return {name: self._topic(name).info for name in names}

    async def topic_offsets(self, topics: Iterable[str]
                            ) -> dict[TopicPartition, tuple[int, int]]:
        return {TopicPartition(name, p): (0, len(log))
                for name in topics for p, log in enumerate(self._topic(name).partitions)}

    async def group_offsets(self, topics: Iterable[str]
                            ) -> dict[str, dict[TopicPartition, int]]:
        names = {self._topic(name).info.name for name in topics}
        offsets = {group_id: {tp: o for tp, o in group.committed.items() if tp.topic in names}
                   for group_id, group in self._groups.items()}
        return {group_id: committed for group_id, committed in offsets.items() if committed}

    def _topic(self, name: str) -> _Topic:
        try:
            return self._topics[name]
        except KeyError:
            raise BusError(f"topic {name!r} does not exist; create it first "
                           "(`miles topics create`)") from None

    async def send(self, topic: str, value: bytes, *, key: bytes | None = None,
                   headers: Headers | None = None,
                   partition: int | None = None) -> Awaitable[Delivery]:
        if self._closed:
            raise BusError("bus is closed")
        check_record_size(topic, value, key, headers)
        state = self._topic(topic)
        if partition is None:
            partition = (zlib.crc32(key) % len(state.partitions) if key is not None
                         else next(state.round_robin))
        elif not 0 <= partition < len(state.partitions):
            raise BusError(f"{topic} has no partition {partition}")
        log = state.partitions[partition]
        record = Record(topic=topic, partition=partition, offset=len(log), key=key,
                        value=bytes(value), headers=tuple(headers or ()),
                        timestamp_ms=int(time.time() * 1000))
        if self._files is not None:
            self._files.append(record)  # on disk before it is acknowledged
        log.append(record)
        self._wake_consumers()
        done = asyncio.get_running_loop().create_future()
        done.set_result(Delivery(topic, partition, len(log) - 1))
        return done

    def _wake_consumers(self) -> None:
        woken, self._new_data = self._new_data, asyncio.Event()
        woken.set()

    async def flush(self) -> None:
        return None

    def consumer(self, topics: Sequence[str], *, group_id: str, from_beginning: bool = True,
                 on_assigned: RebalanceCallback | None = None,
                 on_revoked: RebalanceCallback | None = None) -> EmbeddedConsumer:
        return EmbeddedConsumer(self, list(topics), group_id, from_beginning,
                                on_assigned, on_revoked)

    def _group(self, group_id: str) -> _Group:
        return self._groups.setdefault(group_id, _Group())

    def _log(self, tp: TopicPartition) -> list[Record]:
        return self._topic(tp.topic).partitions[tp.partition]


class EmbeddedConsumer(Consumer):
    def __init__(self, bus: EmbeddedBus, topics: list[str], group_id: str, from_beginning: bool,
                 on_assigned: RebalanceCallback | None, on_revoked: RebalanceCallback | None):
        self.bus = bus
        self.topics = topics
        self.group_id = group_id
        self._from_beginning = from_beginning
        self._on_assigned = on_assigned
        self._on_revoked = on_revoked
        self._positions: dict[TopicPartition, int] = {}
        self._paused: set[TopicPartition] = set()
        self._started = False
        self._turn = 0

    async def start(self) -> None:
        for topic in self.topics:
            self.bus._topic(topic)
        self._started = True
        await self.bus._group(self.group_id).rebalance(joining=self)

    async def close(self) -> None:
        """Leave the group; `on_revoked` runs first and may still commit."""
        if self._started:
            await self.bus._group(self.group_id).rebalance(leaving=self)
            self._started = False

    async def _revoke_all(self) -> None:
        revoked = set(self._positions)
        if self._on_revoked is not None and revoked:
            await self._on_revoked(revoked)
        self._positions.clear()
        self._paused.clear()

    async def _assign(self, tps: set[TopicPartition]) -> None:
        committed = self.bus._group(self.group_id).committed
        for tp in tps:
            reset = 0 if self._from_beginning else len(self.bus._log(tp))
            self._positions[tp] = committed.get(tp, reset)
        if self._on_assigned is not None:
            await self._on_assigned(set(tps))

    def _require_started(self) -> None:
        if not self._started:
            raise BusError("consumer is not started (or already closed)")

    async def poll(self, max_records: int = 500, timeout_s: float = 1.0) -> list[Record]:
        self._require_started()
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            waiter = self.bus._new_data
            records = self._take(max_records)
            remaining = deadline - asyncio.get_running_loop().time()
            if records or remaining <= 0 or not self._started or self.bus._closed:
                return records
            try:
                await asyncio.wait_for(waiter.wait(), remaining)
            except TimeoutError:
                return []

    def _take(self, max_records: int) -> list[Record]:
        readable = sorted(tp for tp in self._positions if tp not in self._paused)
        if not readable:
            return []
        self._turn = (self._turn + 1) % len(readable)
        records: list[Record] = []
        for tp in readable[self._turn:] + readable[:self._turn]:
            log, position = self.bus._log(tp), self._positions[tp]
            batch = log[position:position + max_records - len(records)]
            records.extend(batch)
            self._positions[tp] = position + len(batch)
            if len(records) >= max_records:
                break
        return records

    async def commit(self, offsets: Mapping[TopicPartition, int] | None = None) -> None:
        self._require_started()
        offsets = dict(self._positions) if offsets is None else dict(offsets)
        for tp, offset in offsets.items():
            if tp not in self._positions:
                raise CommitFailedError(f"cannot commit {tp}: not assigned to this consumer")
            if offset < 0:
                raise BusError(f"cannot commit negative offset {offset} for {tp}")
        group = self.bus._group(self.group_id)
        group.committed.update(offsets)
        if self.bus._files is not None:
            self.bus._files.commit(self.group_id, group.committed)

    async def committed(self, tp: TopicPartition) -> int | None:
        return self.bus._group(self.group_id).committed.get(tp)

    def assignment(self) -> set[TopicPartition]:
        return set(self._positions)

    async def position(self, tp: TopicPartition) -> int:
        self._check_assigned(tp)
        return self._positions[tp]

    def _check_assigned(self, tp: TopicPartition) -> None:
        if tp not in self._positions:
            raise BusError(f"{tp} is not assigned to this consumer")

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self._check_assigned(tp)
        if offset < 0:
            raise BusError(f"cannot seek {tp} to negative offset {offset}")
        self._positions[tp] = offset

    async def seek_to_time(self, timestamp_ms: int,
                           tps: Iterable[TopicPartition] | None = None) -> dict[TopicPartition, int]:
        targets = {}
        for tp in (self.assignment() if tps is None else tps):
            log = self.bus._log(tp)
            targets[tp] = next((r.offset for r in log if r.timestamp_ms >= timestamp_ms), len(log))
            self.seek(tp, targets[tp])
        return targets

    async def end_offsets(self, tps: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        return {tp: len(self.bus._log(tp)) for tp in tps}

    async def beginning_offsets(self,
                                tps: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        return {tp: 0 for tp in tps if self.bus._log(tp) is not None}

    def pause(self, *tps: TopicPartition) -> None:
        for tp in tps:
            self._check_assigned(tp)
        self._paused.update(tps)

    def resume(self, *tps: TopicPartition) -> None:
        self._paused.difference_update(tps)
