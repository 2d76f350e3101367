"""The message-bus contract every Miles component talks to.

Two implementations keep the same semantics: `KafkaBus` (aiokafka against a real broker) and
`EmbeddedBus` (in-process, for one machine without Java). The semantics are Kafka's: topics of
ordered partitions, per-partition offsets, consumer groups that share partitions, manual commits
of "the next offset to read", seeking by offset or by timestamp, and pause/resume.

Values, keys and header values are bytes: the bus moves records, the protocol package gives them
meaning. A consumed value may be None: a tombstone, which Miles never writes but another client
can (the codec rejects it like any invalid record). Sizes are checked before sending (`check_record_size`) so an oversized record fails at the
caller with the limit named, on both buses alike.
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from miles.errors import RecordTooLargeError
from miles.protocol.topics import MAX_RECORD_BYTES, TopicSpec

Headers = Sequence[tuple[str, bytes]]
RebalanceCallback = Callable[[set["TopicPartition"]], Awaitable[None]]

# Kafka's per-record framing is a few varints; a generous fixed allowance keeps the check simple.
RECORD_FRAMING_BYTES = 64


class TopicPartition(NamedTuple):
    topic: str
    partition: int


@dataclass(frozen=True, slots=True)
class Record:
    """One consumed record."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None  # None: a tombstone (a null value; Miles never writes one)
    headers: tuple[tuple[str, bytes], ...]
    timestamp_ms: int

    @property
    def tp(self) -> TopicPartition:
        return TopicPartition(self.topic, self.partition)


@dataclass(frozen=True, slots=True)
class Delivery:
    """Where a published record landed."""

    topic: str
    partition: int
    offset: int


@dataclass(frozen=True, kw_only=True)
class TopicInfo:
    name: str
    partitions: int
    configs: dict[str, str]


def record_size(value: bytes, key: bytes | None, headers: Headers | None) -> int:
    size = len(value) + (len(key) if key else 0) + RECORD_FRAMING_BYTES
    for name, header_value in headers or ():
        size += len(name.encode()) + len(header_value)
    return size


def check_record_size(topic: str, value: bytes, key: bytes | None,
                      headers: Headers | None, limit: int = MAX_RECORD_BYTES) -> None:
    size = record_size(value, key, headers)
    if size > limit:
        raise RecordTooLargeError(
            f"record for {topic} is {size} bytes, over the limit of {limit} bytes "
            "(miles.protocol.topics.MAX_RECORD_BYTES); large payloads such as weights go by "
            "URI + sha256, not through the bus")


class Consumer(abc.ABC):
    """A member of a consumer group, reading the partitions the group assigns it.

    Positions start at the group's committed offset, or at the earliest (default) or latest
    offset when the group has none. Nothing is committed unless `commit` is called.
    """

    group_id: str

    async def __aenter__(self) -> Consumer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None:
        """Leave the group (its partitions move to the other members); never commits."""

    @abc.abstractmethod
    async def poll(self, max_records: int = 500, timeout_s: float = 1.0) -> list[Record]:
        """Up to `max_records` records, waiting at most `timeout_s` for the first one."""

    @abc.abstractmethod
    async def commit(self, offsets: Mapping[TopicPartition, int] | None = None) -> None:
        """Commit next-offsets-to-read; None commits the position after every record polled."""

    @abc.abstractmethod
    async def committed(self, tp: TopicPartition) -> int | None: ...

    @abc.abstractmethod
    def assignment(self) -> set[TopicPartition]: ...

    @abc.abstractmethod
    async def position(self, tp: TopicPartition) -> int: ...

    @abc.abstractmethod
    def seek(self, tp: TopicPartition, offset: int) -> None:
        """The next poll of `tp` starts at `offset`."""

    @abc.abstractmethod
    async def seek_to_time(self, timestamp_ms: int,
                           tps: Iterable[TopicPartition] | None = None) -> dict[TopicPartition, int]:
        """Seek each partition to its first record with timestamp >= `timestamp_ms` (or its end)."""

    @abc.abstractmethod
    async def end_offsets(self, tps: Iterable[TopicPartition]) -> dict[TopicPartition, int]: ...

    @abc.abstractmethod
    async def beginning_offsets(self,
                                tps: Iterable[TopicPartition]) -> dict[TopicPartition, int]: ...

    @abc.abstractmethod
    def pause(self, *tps: TopicPartition) -> None: ...

    @abc.abstractmethod
    def resume(self, *tps: TopicPartition) -> None: ...


class Bus(abc.ABC):
    """Publishing, topic administration, offsets for monitoring and a factory for consumers."""

    url: str

    async def __aenter__(self) -> Bus:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None:
        """Flush pending records, then release connections."""

    @abc.abstractmethod
    async def create_topics(self, specs: Iterable[TopicSpec]) -> list[str]:
        """Create missing topics; returns the names created (existing ones are left alone)."""

    @abc.abstractmethod
    async def describe_topics(self, names: Iterable[str]) -> dict[str, TopicInfo]: ...

    @abc.abstractmethod
    async def topic_offsets(self, topics: Iterable[str]
                            ) -> dict[TopicPartition, tuple[int, int]]:
        """(first, end) offsets of every partition of `topics`: the log holds [first, end)."""

    @abc.abstractmethod
    async def group_offsets(self, topics: Iterable[str]
                            ) -> dict[str, dict[TopicPartition, int]]:
        """Committed offsets of every consumer group on `topics`: group id -> {partition: next
        offset to read} over the partitions of `topics` it committed; groups that committed
        none are left out. Joins no group and moves nothing (monitoring reads this)."""

    @abc.abstractmethod
    async def send(self, topic: str, value: bytes, *, key: bytes | None = None,
                   headers: Headers | None = None,
                   partition: int | None = None) -> Awaitable[Delivery]:
        """Queue a record and return an awaitable of its delivery (for pipelined publishing)."""

    async def publish(self, topic: str, value: bytes, *, key: bytes | None = None,
                      headers: Headers | None = None, partition: int | None = None) -> Delivery:
        """Publish one record and wait until the bus has stored it."""
        return await (await self.send(topic, value, key=key, headers=headers,
                                      partition=partition))

    @abc.abstractmethod
    async def flush(self) -> None: ...

    @abc.abstractmethod
    def consumer(self, topics: Sequence[str], *, group_id: str, from_beginning: bool = True,
                 on_assigned: RebalanceCallback | None = None,
                 on_revoked: RebalanceCallback | None = None) -> Consumer:
        """A consumer in `group_id` for `topics`; call `start()` (or `async with`) before use."""
