"""A consumer that hands out decoded records and dead-letters the rest.

Every record from the wire is untrusted. A record that does not decode (garbage, truncated, wrong
types, NaN logprobs, a newer major schema, a record type its topic does not carry, a Kafka
tombstone, too many objects, ...) is published to the run's DLQ topic as a `DeadLetter` carrying
the reason, its source topic, partition and offset, and the consumer group and consumer that
rejected it; it is counted under its reason and skipped: the consumer never stops on bad data.
Its offset is still consumed, so `commit()` moves past it: the DLQ, not the source topic, is where
it is kept. A valid record of a type the topic carries but this consumer does not read (a
`command` on control for a reader of weight versions) is not bad data: it is counted under
`bus/skipped_records` and skipped.

Duplicates. A letter's Kafka key is `<group>/<source topic>/<partition>/<offset>`
(`DeadLetter.key`), the same for every letter of one group about one record. A consumer
remembers the records it dead-lettered (the last `REMEMBERED_LETTERS`), so a record it reads
again (a rewind, a session expiry or a rebalance that gives its partition back) is not lettered
twice. What this cannot see: a record re-read after a restart, or by another member that took
the partition over before the commit covering it, is lettered again under the same key; readers
of the DLQ (`miles stats`) count letters once per key. A producer letters each failed episode
of a prompt (`part` = `episode-<i>`, its own key) with the episode's group as payload.

Decoding cannot starve the event loop: each record's work is bounded by the codec
(`MAX_OBJECTS_PER_RECORD`, checked while it builds), and `poll` yields to the loop whenever it
has decoded for `DECODE_SLICE_S` without a pause.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass

from miles.bus.base import Bus, Consumer, Record, TopicPartition
from miles.errors import CodecError
from miles.protocol import DeadLetter, WireRecord, decode, encode
from miles.protocol.records import dead_letter_key
from miles.protocol.schema import TYPES_BY_NAME
from miles.protocol.topics import CARRIED, topic_kind

log = logging.getLogger(__name__)
DECODE_SLICE_S = 0.02  # longest run of decoding between two yields to the event loop
REMEMBERED_LETTERS = 100_000  # (partition, offset) of recent dead letters, not sent twice


@dataclass(frozen=True, slots=True)
class Decoded:
    record: Record
    value: WireRecord


class DecodingConsumer:
    """Wraps a started `Consumer`; `poll` returns only records that decoded as `expected`.

    `name` names this consumer in its dead letters (e.g. a producer's id); its group is the
    wrapped consumer's.
    """

    def __init__(self, bus: Bus, consumer: Consumer, *, dlq_topic: str,
                 expected: type[WireRecord] | tuple[type[WireRecord], ...],
                 name: str | None = None):
        self.bus = bus
        self.consumer = consumer
        self.dlq_topic = dlq_topic
        self.expected = expected
        self.name = name
        self.counts: Counter[str] = Counter()
        self.dlq_reasons: Counter[str] = Counter()
        self.polled: dict[TopicPartition, int] = {}  # next offsets after the last poll's records
        self._lettered: dict[tuple[TopicPartition, int, str | None], None] = {}  # ordered
        self._carried_by_topic: dict[str, tuple[type[WireRecord], ...]] = {}

    async def poll(self, max_records: int = 500, timeout_s: float = 1.0) -> list[Decoded]:
        """The records of one poll that decoded; `polled` says where the poll ended (dead
        letters and skipped records included), i.e. what to commit once the decoded ones are
        handled."""
        decoded = []
        records = await self.consumer.poll(max_records=max_records, timeout_s=timeout_s)
        self.polled = {}
        sliced = time.perf_counter()
        for record in records:
            self.polled[record.tp] = max(self.polled.get(record.tp, 0), record.offset + 1)
            self.counts["bus/records"] += 1
            self.counts["bus/bytes"] += len(record.value or b"")
            try:
                value = decode(record.value, self._carried(record.topic))
            except CodecError as err:
                await self.dead_letter(record, str(err), err.field)
                sliced = time.perf_counter()  # publishing the letter yielded
                continue
            if isinstance(value, self.expected):
                decoded.append(Decoded(record, value))
            else:
                self.counts["bus/skipped_records"] += 1
            if time.perf_counter() - sliced >= DECODE_SLICE_S:
                await asyncio.sleep(0)
                sliced = time.perf_counter()
        return decoded

    def _carried(self, topic: str) -> tuple[type[WireRecord], ...]:
        """What `topic` may carry: its kind's record types (`topics.CARRIED`) and what this
        consumer reads; any other type is a dead letter."""
        carried = self._carried_by_topic.get(topic)
        if carried is None:
            reads = self.expected if isinstance(self.expected, tuple) else (self.expected,)
            kind = topic_kind(topic)
            names = CARRIED[kind] if kind is not None else ()
            carried = tuple(dict.fromkeys((*(TYPES_BY_NAME[n] for n in names), *reads)))
            self._carried_by_topic[topic] = carried
        return carried

    async def dead_letter(self, record: Record, reason: str, field: str = "record", *,
                          part: str | None = None, payload: bytes | None = None) -> None:
        """Send `record` to the DLQ with `reason` (also usable for records rejected later),
        unless this consumer already did. `part` names one of several letters about `record`
        (a failed episode of a prompt: its key ends in `/<part>`); such a letter carries
        `payload` instead of the record's bytes."""
        seen = (record.tp, record.offset, part)
        if seen in self._lettered:
            self.counts["bus/dlq_repeats"] += 1
            return
        group = self.consumer.group_id
        letter = DeadLetter.for_payload(
            reason=reason, source_topic=record.topic, source_partition=record.partition,
            source_offset=record.offset, payload=record.value if part is None else payload,
            created_at=time.time(), consumer_group=group, consumer=self.name or group)
        key = dead_letter_key(group, record.topic, record.partition, record.offset, part)
        await self.bus.publish(self.dlq_topic, encode(letter), key=key)
        self._remember(seen)
        self.counts["bus/dlq_records"] += 1
        self.dlq_reasons[field] += 1
        log.warning("dead-lettered %s[%d]@%d%s: %s", record.topic, record.partition,
                    record.offset, "" if part is None else f" ({part})", reason)

    def _remember(self, seen: tuple[TopicPartition, int, str | None]) -> None:
        self._lettered[seen] = None
        if len(self._lettered) > REMEMBERED_LETTERS:
            del self._lettered[next(iter(self._lettered))]
