"""Reading a bounded range of a recorded topic in a fixed order (replay, export, stats).

A range has a start and an end bound, each one of: `earliest`, `latest`, an offset (the same in
every partition, e.g. `1200`), or a time: ISO 8601 (`2026-12-03T06:00:00Z`; no zone means UTC)
or `@<epoch milliseconds>`. The start is inclusive, the end exclusive; both are resolved once,
when reading starts, so records published meanwhile do not stretch the range. An offset end past
a partition's end is cut to it.

Order: records are merged across partitions by (timestamp, partition, offset). Reading the same
range twice yields the same sequence whatever the fetch timing, which replay's determinism rests
on. A record is yielded only once every unfinished partition has its next record in hand.

Retention: a start before a partition's first retained record (the older ones were deleted by
retention) fails at once with `RangeError` saying what is still there, instead of silently
starting later. With a time start, a partition whose log no longer begins at offset 0 and whose
first retained record already lies inside the range counts as such a case: what was deleted
may have belonged to the range.

Reading uses a consumer group of its own (`group_id`) and commits nothing, so it never moves the
live run's groups.
"""

from __future__ import annotations

import re
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Literal

from miles.bus.base import Bus, Consumer, Record, TopicPartition
from miles.errors import ConfigError, MilesError


class RangeError(MilesError):
    """The requested range cannot be read as asked (e.g. part of it was deleted)."""


@dataclass(frozen=True)
class Bound:
    kind: Literal["earliest", "latest", "offset", "time"]
    value: int = 0  # the offset, or the time in epoch milliseconds


def parse_bound(text: str | Bound) -> Bound:
    """`earliest`, `latest`, an offset, `@<epoch ms>` or an ISO 8601 time (UTC if no zone); a
    `Bound` is returned as it is."""
    if isinstance(text, Bound):
        return text
    text = str(text).strip()
    if text in ("earliest", "latest"):
        return Bound(text)
    if re.fullmatch(r"\d+", text):
        return Bound("offset", int(text))
    if re.fullmatch(r"@\d+", text):
        return Bound("time", int(text[1:]))
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ConfigError(f"range bound must be earliest, latest, an offset, @<epoch ms> or an "
                          f"ISO 8601 time, got {text!r}") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return Bound("time", int(moment.timestamp() * 1000))


def reader_group(run: str, purpose: str) -> str:
    """A fresh consumer group id: range reads commit nothing and share no group."""
    return f"miles.{run}.{purpose}.{uuid.uuid4().hex[:12]}"


async def assign_all(bus: Bus, consumer: Consumer, topic: str) -> list[TopicPartition]:
    """Poll until the (only) member of a fresh group holds every partition of `topic`."""
    partitions = (await bus.describe_topics([topic]))[topic].partitions
    wanted = {TopicPartition(topic, p) for p in range(partitions)}
    while consumer.assignment() != wanted:
        await consumer.poll(timeout_s=0.2)  # records seen here are read again after the seek
    return sorted(wanted)


async def _offsets_at(consumer: Consumer, tps: list[TopicPartition], bound: Bound,
                      first: dict, last: dict) -> dict[TopicPartition, int]:
    if bound.kind == "earliest":
        return dict(first)
    if bound.kind == "latest":
        return dict(last)
    if bound.kind == "offset":
        return {tp: min(bound.value, last[tp]) for tp in tps}
    return await consumer.seek_to_time(bound.value, tps)


async def resolve_range(consumer: Consumer, tps: list[TopicPartition], start: Bound,
                        end: Bound) -> dict[TopicPartition, tuple[int, int]]:
    """Per partition, the [first, end) offsets of the range; RangeError if part of it is gone."""
    first = await consumer.beginning_offsets(tps)
    last = await consumer.end_offsets(tps)
    lo = await _offsets_at(consumer, tps, start, first, last)
    hi = await _offsets_at(consumer, tps, end, first, last)
    for tp in tps:
        deleted = first[tp] > 0 and lo[tp] <= first[tp] < last[tp] and (
            start.kind == "time" or (start.kind == "offset" and start.value < first[tp]))
        if deleted:
            raise RangeError(
                f"{tp.topic}[{tp.partition}]: the range starts before offset {first[tp]}, the "
                f"oldest record the broker still keeps (older ones were deleted by retention); "
                f"ask for a later start, or 'earliest' for what is left")
    return {tp: (lo[tp], max(lo[tp], hi[tp])) for tp in tps}


async def read_range(bus: Bus, topic: str, start: Bound, end: Bound, *, group_id: str,
                     counts: dict | None = None) -> AsyncIterator[Record]:
    """The records of `topic` in [start, end), merged in (timestamp, partition, offset) order.
    `counts`, if given, gets "range/records" (the range's size over all partitions)."""
    async with bus.consumer([topic], group_id=group_id) as consumer:
        tps = await assign_all(bus, consumer, topic)
        bounds = await resolve_range(consumer, tps, start, end)
        if counts is not None:
            counts["range/records"] = sum(hi - lo for lo, hi in bounds.values())
        for tp, (lo, _) in bounds.items():
            consumer.seek(tp, lo)
        heads: dict[TopicPartition, deque[Record]] = {tp: deque() for tp in tps}
        open_tps = {tp for tp, (lo, hi) in bounds.items() if lo < hi}
        while open_tps:
            waiting = [tp for tp in open_tps if not heads[tp]]
            if waiting:
                await _fill(consumer, heads, bounds, waiting, open_tps)
                continue
            tp = min(open_tps, key=lambda t: (heads[t][0].timestamp_ms, t.partition,
                                              heads[t][0].offset))
            record = heads[tp].popleft()
            if record.offset + 1 >= bounds[tp][1]:
                open_tps.discard(tp)
            yield record


async def _fill(consumer: Consumer, heads: dict, bounds: dict, waiting: list,
                open_tps: set) -> None:
    """One poll into the per-partition queues; closes partitions that reached their end (also
    across offset gaps, e.g. transaction markers)."""
    for record in await consumer.poll(timeout_s=0.5):
        lo, hi = bounds[record.tp]
        if lo <= record.offset < hi:
            heads[record.tp].append(record)
    for tp in waiting:
        if not heads[tp] and await consumer.position(tp) >= bounds[tp][1]:
            open_tps.discard(tp)
    for tp in set(heads) - open_tps:
        if not heads[tp] and tp in consumer.assignment():
            consumer.pause(tp)
