"""The Kafka consumer (part of the Kafka adapter, like kafka.py): one member of a consumer group.

Manual commits only; earliest reset unless asked otherwise; fetch sizes from
`miles.protocol.topics`, so no record the topic accepts can stall it. Each start attempt builds
a fresh aiokafka client (one whose start failed cannot start again) and stops it when the start
fails, so a refused or retried start leaves no client unclosed; waiting for a broker that is
not up yet and failing at once on a refused identity or a denied group is `kafka_errors.retrying`.
A commit refused because the group's membership changed raises `CommitFailedError`. aiokafka
does not revoke on stop; `close` does, as the embedded bus does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping

from aiokafka import AIOKafkaConsumer
from aiokafka import TopicPartition as KafkaTopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.errors import (CommitFailedError as KafkaCommitFailedError, IllegalGenerationError,
                             IllegalStateError, KafkaError, RebalanceInProgressError,
                             UnknownMemberIdError)

from miles.bus.base import Consumer, RebalanceCallback, Record, TopicPartition
from miles.bus.kafka import REQUEST_TIMEOUT_MS, KafkaBus
from miles.bus.kafka_errors import retrying
from miles.bus.kafka_errors import wrapped as _wrapped
from miles.errors import BusError, CommitFailedError
from miles.protocol.topics import CONSUMER_FETCH_MAX_BYTES, CONSUMER_MAX_PARTITION_FETCH_BYTES

# Commit errors that mean the group's membership changed (IllegalStateError: the partition is
# no longer assigned to this member): raised as `CommitFailedError`.
MEMBERSHIP_ERRORS = (KafkaCommitFailedError, IllegalGenerationError, RebalanceInProgressError,
                     UnknownMemberIdError, IllegalStateError)


class _Listener(ConsumerRebalanceListener):
    def __init__(self, on_assigned: RebalanceCallback | None,
                 on_revoked: RebalanceCallback | None):
        self._on_assigned = on_assigned
        self._on_revoked = on_revoked

    async def on_partitions_revoked(self, revoked: Iterable[KafkaTopicPartition]) -> None:
        await self.revoke({TopicPartition(tp.topic, tp.partition) for tp in revoked})

    async def revoke(self, revoked: set[TopicPartition]) -> None:
        if self._on_revoked is not None and revoked:
            await self._on_revoked(revoked)

    async def on_partitions_assigned(self, assigned: Iterable[KafkaTopicPartition]) -> None:
        if self._on_assigned is not None:
            await self._on_assigned({TopicPartition(tp.topic, tp.partition) for tp in assigned})


def _kafka_tp(tp: TopicPartition) -> KafkaTopicPartition:
    return KafkaTopicPartition(tp.topic, tp.partition)


class KafkaConsumer(Consumer):
    def __init__(self, bus: KafkaBus, topics: list[str], group_id: str, from_beginning: bool,
                 on_assigned: RebalanceCallback | None, on_revoked: RebalanceCallback | None):
        self.bus = bus
        self.topics = topics
        self.group_id = group_id
        self._reset = "earliest" if from_beginning else "latest"
        self._started: AIOKafkaConsumer | None = None  # the client, once it has started
        self._listener = _Listener(on_assigned, on_revoked)

    def _client(self) -> AIOKafkaConsumer:
        return AIOKafkaConsumer(
            bootstrap_servers=self.bus.bootstrap, client_id=self.bus.client_id,
            group_id=self.group_id, enable_auto_commit=False, auto_offset_reset=self._reset,
            max_partition_fetch_bytes=CONSUMER_MAX_PARTITION_FETCH_BYTES,
            fetch_max_bytes=CONSUMER_FETCH_MAX_BYTES, request_timeout_ms=REQUEST_TIMEOUT_MS,
            **self.bus.options)

    async def start(self) -> None:
        await retrying(f"starting consumer {self.group_id}", self._connect, self.bus.diagnose,
                       self.bus.security)

    async def _connect(self) -> None:
        """One attempt with a fresh client (one whose start failed cannot start again); a
        refused or failed start stops the client it made, so nothing is left unclosed. The
        client is this consumer's while it starts: the group's first assignment can arrive
        before `start()` returns, and the rebalance callbacks seek it."""
        client = self._client()
        client.subscribe(self.topics, listener=self._listener)
        self._started = client
        try:
            await client.start()
        except BaseException:
            self._started = None
            with contextlib.suppress(KafkaError):
                await client.stop()
            raise

    @property
    def _consumer(self) -> AIOKafkaConsumer:
        if self._started is None:
            raise BusError(f"consumer {self.group_id} is not started (or already closed)")
        return self._started

    async def close(self) -> None:
        """Revoke (aiokafka does not on stop, the embedded bus does), then leave the group."""
        if self._started is None:
            return
        await self._listener.revoke(self.assignment())
        client, self._started = self._started, None
        with _wrapped(f"closing consumer {self.group_id}", self.bus.security):
            await client.stop()

    async def poll(self, max_records: int = 500, timeout_s: float = 1.0) -> list[Record]:
        with _wrapped("polling", self.bus.security):
            batches = await self._consumer.getmany(timeout_ms=int(timeout_s * 1000),
                                                   max_records=max_records)
        return [Record(topic=r.topic, partition=r.partition, offset=r.offset, key=r.key,
                       value=r.value, headers=tuple(r.headers), timestamp_ms=r.timestamp)
                for records in batches.values() for r in records]

    async def commit(self, offsets: Mapping[TopicPartition, int] | None = None) -> None:
        kafka_offsets = None if offsets is None else {
            _kafka_tp(tp): offset for tp, offset in offsets.items()}
        try:
            with _wrapped("committing offsets", self.bus.security):
                await self._consumer.commit(kafka_offsets)
        except BusError as err:
            if isinstance(err.__cause__, MEMBERSHIP_ERRORS):
                raise CommitFailedError(str(err)) from err.__cause__
            raise

    async def committed(self, tp: TopicPartition) -> int | None:
        with _wrapped("reading committed offset", self.bus.security):
            return await self._consumer.committed(_kafka_tp(tp))

    def assignment(self) -> set[TopicPartition]:
        if self._started is None:
            return set()
        return {TopicPartition(tp.topic, tp.partition) for tp in self._started.assignment()}

    async def position(self, tp: TopicPartition) -> int:
        with _wrapped("reading position", self.bus.security):
            return await self._consumer.position(_kafka_tp(tp))

    def seek(self, tp: TopicPartition, offset: int) -> None:
        if tp not in self.assignment():
            raise BusError(f"{tp} is not assigned to this consumer")
        if offset < 0:
            raise BusError(f"cannot seek {tp} to negative offset {offset}")
        self._consumer.seek(_kafka_tp(tp), offset)

    async def seek_to_time(self, timestamp_ms: int,
                           tps: Iterable[TopicPartition] | None = None) -> dict[TopicPartition, int]:
        tps = list(self.assignment() if tps is None else tps)
        with _wrapped("looking up offsets by time", self.bus.security):
            found = await self._consumer.offsets_for_times(
                {_kafka_tp(tp): timestamp_ms for tp in tps})
        ends = await self.end_offsets(tps)
        targets = {}
        for tp in tps:
            hit = found.get(_kafka_tp(tp))
            targets[tp] = hit.offset if hit is not None else ends[tp]
            self.seek(tp, targets[tp])
        return targets

    async def end_offsets(self, tps: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        with _wrapped("reading end offsets", self.bus.security):
            ends = await self._consumer.end_offsets([_kafka_tp(tp) for tp in tps])
        return {TopicPartition(tp.topic, tp.partition): offset for tp, offset in ends.items()}

    async def beginning_offsets(self,
                                tps: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        with _wrapped("reading beginning offsets", self.bus.security):
            starts = await self._consumer.beginning_offsets([_kafka_tp(tp) for tp in tps])
        return {TopicPartition(tp.topic, tp.partition): offset for tp, offset in starts.items()}

    def pause(self, *tps: TopicPartition) -> None:
        self._consumer.pause(*(_kafka_tp(tp) for tp in tps))

    def resume(self, *tps: TopicPartition) -> None:
        self._consumer.resume(*(_kafka_tp(tp) for tp in tps))
