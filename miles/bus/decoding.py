"""A consumer that hands out decoded records and dead-letters the rest.

Every record from the wire is untrusted. A record that does not decode (garbage, truncated, wrong
types, NaN logprobs, a newer major schema, the wrong record type for this topic, ...) is published
to the run's DLQ topic as a `DeadLetter` carrying the reason and its source topic, partition and
offset, counted under its reason, and skipped; the consumer never stops on bad data. Its offset is
still consumed, so `commit()` moves past it: the DLQ, not the source topic, is where it is kept.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass

from miles.bus.base import Bus, Consumer, Record, TopicPartition
from miles.errors import CodecError
from miles.protocol import DeadLetter, WireRecord, decode, encode

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Decoded:
    record: Record
    value: WireRecord


class DecodingConsumer:
    """Wraps a started `Consumer`; `poll` returns only records that decoded as `expected`."""

    def __init__(self, bus: Bus, consumer: Consumer, *, dlq_topic: str,
                 expected: type[WireRecord] | tuple[type[WireRecord], ...]):
        self.bus = bus
        self.consumer = consumer
        self.dlq_topic = dlq_topic
        self.expected = expected
        self.counts: Counter[str] = Counter()
        self.dlq_reasons: Counter[str] = Counter()
        self.polled: dict[TopicPartition, int] = {}  # next offsets after the last poll's records

    async def poll(self, max_records: int = 500, timeout_s: float = 1.0) -> list[Decoded]:
        """The records of one poll that decoded; `polled` says where the poll ended (dead
        letters included), i.e. what to commit once the decoded ones are handled."""
        decoded = []
        records = await self.consumer.poll(max_records=max_records, timeout_s=timeout_s)
        self.polled = {}
        for record in records:
            self.polled[record.tp] = max(self.polled.get(record.tp, 0), record.offset + 1)
            self.counts["bus/records"] += 1
            self.counts["bus/bytes"] += len(record.value)
            try:
                decoded.append(Decoded(record, decode(record.value, self.expected)))
            except CodecError as err:
                await self.dead_letter(record, str(err), err.field)
        return decoded

    async def dead_letter(self, record: Record, reason: str, field: str = "record") -> None:
        """Send `record` to the DLQ with `reason` (also usable for records rejected later)."""
        letter = DeadLetter.for_payload(
            reason=reason, source_topic=record.topic, source_partition=record.partition,
            source_offset=record.offset, payload=record.value, created_at=time.time())
        await self.bus.publish(self.dlq_topic, encode(letter), key=record.topic.encode())
        self.counts["bus/dlq_records"] += 1
        self.dlq_reasons[field] += 1
        log.warning("dead-lettered %s[%d]@%d: %s", record.topic, record.partition,
                    record.offset, reason)
