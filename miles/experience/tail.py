"""`tail`: follow a topic of a run and describe each record on one line as it arrives.

Choices:
- Each tail reads in a fresh consumer group and commits nothing, so it never moves a live group.
- It starts at the latest offsets (what is published from then on) or at a range bound
  (`earliest`, an offset, a time). The positions are set before `ready` is set, so a caller
  that publishes afterwards misses nothing.
- Records are shown as they arrive: each partition in order, partitions interleaved as fetched.
- A record that does not decode as the topic's record type is shown as INVALID with the codec's
  reason. A failed episode's dead letter also shows its payload's group (turns, policy tokens). The raw view unpacks the msgpack envelope and checks nothing else: an array map whose
  dtype and size agree is shown as its numbers, any other bytes as hex (the first
  `BYTES_SHOWN`). Nothing is ever unpickled or evaluated.
- With a `tokenizer` (`miles tail --model-dir`), a trajectory group's line is followed by its
  transcript (`miles.experience.transcript`: each turn's model and environment text, reward,
  finish); without one, the summary line only.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator
from datetime import datetime, timezone

import numpy as np

from miles.bus.base import Bus, Record
from miles.bus.ranges import Bound, assign_all, parse_bound, reader_group, resolve_range
from miles.errors import CodecError
from miles.protocol import (FLOAT_DTYPE, TOKEN_DTYPE, Command, DeadLetter, Heartbeat, PromptTask,
                            TrajectoryGroup, WeightVersion, WireRecord, decode)
from miles.experience.rows import turns
from miles.experience.transcript import transcript
from miles.protocol.codec import unpack
from miles.protocol.limits import MASK_DTYPE
from miles.protocol.records import failed_episode_kind
from miles.protocol.topics import topic_name

EXPECTED = {"prompts": PromptTask, "trajectories": TrajectoryGroup,
            "control": (WeightVersion, Command), "status": Heartbeat, "dlq": DeadLetter}
"""The record types each topic kind carries (what its consumers accept)."""

POLL_S = 0.5  # how long a poll waits before the stop event is looked at again
ITEMS_SHOWN = 16  # per-sample values shown for a group
BYTES_SHOWN = 32
TEXT_SHOWN = 60


async def tail(bus: Bus, run: str, kind: str = "trajectories", *, raw: bool = False,
               start: Bound | str = "latest", limit: int | None = None,
               stop: asyncio.Event | None = None, ready: asyncio.Event | None = None,
               tokenizer=None) -> AsyncIterator[str]:
    """One line per record of the run's `kind` topic from `start` on (a group's transcript
    under it with a `tokenizer`), until `limit` records, `stop` is set, or the caller stops
    iterating."""
    topic = topic_name(run, kind)
    async with bus.consumer([topic], group_id=reader_group(run, "tail")) as consumer:
        tps = await assign_all(bus, consumer, topic)
        bounds = await resolve_range(consumer, tps, parse_bound(start), parse_bound("latest"))
        for tp, (first, _) in bounds.items():
            consumer.seek(tp, first)
        if ready is not None:
            ready.set()
        shown = 0
        while (limit is None or shown < limit) and not (stop is not None and stop.is_set()):
            for record in await consumer.poll(timeout_s=POLL_S):
                yield describe(record, EXPECTED[kind], raw=raw, tokenizer=tokenizer)
                shown += 1
                if shown == limit:
                    return


def describe(record: Record, expected: type | tuple, *, raw: bool = False,
             tokenizer=None) -> str:
    """`partition@offset time` and the record, decoded (or raw); INVALID with the reason. A
    group's transcript follows on more lines when a `tokenizer` is given."""
    head = f"{record.partition}@{record.offset} {_time(record.timestamp_ms)}"
    try:
        if raw:
            return f"{head} {json.dumps(plain(unpack(record.value)), ensure_ascii=False)}"
        value = decode(record.value, expected)
    except CodecError as err:
        return f"{head} INVALID {err}"
    line = f"{head} {summarize(value)}"
    if tokenizer is not None and isinstance(value, TrajectoryGroup):
        line = "\n".join([line, *transcript(value, tokenizer)])
    return line


def _episodes(group: TrajectoryGroup) -> str:
    """` turns [..] policy [..]` (turns, and policy / all tokens, per sample) when the group
    holds an episode (1.4), else nothing."""
    if all(s.loss_mask is None for s in group.samples):
        return ""
    policy = (f"{s.policy_tokens}/{len(s.response_token_ids)}" for s in group.samples)
    return f" turns {_items(turns(s) for s in group.samples)} policy {_items(policy)}"


def summarize(value: WireRecord) -> str:
    """The record's type and its telling fields, on one line."""
    match value:
        case TrajectoryGroup():
            newest = max(int(s.versions.max()) for s in value.samples)
            finish = Counter(s.finish_reason for s in value.samples)
            errors = sum(s.error is not None for s in value.samples)
            return (f"group {value.group_id} task {value.task_id} producer {value.producer_id} "
                    f"({value.engine}) v{value.min_version}..{newest} "
                    f"rewards {_items(f'{s.reward:.3g}' for s in value.samples)} "
                    f"lengths {_items(len(s.response_token_ids) for s in value.samples)} "
                    f"finish {' '.join(f'{k}:{n}' for k, n in finish.items())}"
                    + (f" reward_errors {errors}" if errors else "") + _episodes(value))
        case WeightVersion():
            return (f"weight_version v{value.policy_version} step {value.step} {value.format} "
                    f"{value.bytes} bytes sha256 {value.sha256[:12]}… {value.uri}")
        case Command():
            return f"command {value.command} target {value.target} reason {_text(value.reason)}"
        case Heartbeat():
            extra = " ".join(f"{k}={v}" for k, v in value.extra.items())
            return (f"heartbeat {value.producer_id} {value.role} ({value.engine or '-'}) "
                    f"v{value.policy_version} in_flight {value.in_flight} "
                    f"tokens/s {value.tokens_per_s:.1f}" + (f" {extra}" if extra else ""))
        case DeadLetter():
            by = f" by {value.consumer} ({value.consumer_group})" if value.consumer_group else ""
            return (f"dead_letter from {value.source_topic}[{value.source_partition}]@"
                    f"{value.source_offset} ({value.payload_size} bytes){by}: {value.reason}"
                    + _failed_episode(value))
        case PromptTask():
            return (f"prompt_task {value.task_id} epoch {value.epoch} {_text(value.prompt)}"
                    + (f" reference {_text(value.reference)}" if value.reference else ""))
    return type(value).__name__


def _failed_episode(letter: DeadLetter) -> str:
    """` | group ...` (the payload's group, described) for a failed episode's letter whose
    payload decodes; else nothing."""
    if failed_episode_kind(letter.reason) is None or not letter.payload:
        return ""
    try:
        return f" | {summarize(decode(letter.payload, TrajectoryGroup))}"
    except CodecError as err:
        return f" | payload INVALID {err}"


def plain(value: object) -> object:
    """Unpacked msgpack as JSON-ready data: array maps as numbers, other bytes as hex."""
    if isinstance(value, dict):
        if _is_array_map(value):
            return np.frombuffer(value["data"], dtype=value["dtype"]).tolist()
        return {(k if isinstance(k, str) else _hex(k)): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, bytes):
        return _hex(value)
    return value


_ITEMSIZES = {d.str: d.itemsize for d in (TOKEN_DTYPE, FLOAT_DTYPE, MASK_DTYPE)}


def _is_array_map(value: dict) -> bool:
    dtype, length, data = value.get("dtype"), value.get("length"), value.get("data")
    size = _ITEMSIZES.get(dtype)
    return (len(value) == 3 and size is not None and isinstance(length, int)
            and isinstance(data, bytes) and len(data) == size * length)


def _hex(data: bytes) -> str:
    more = "…" if len(data) > BYTES_SHOWN else ""
    return f"<{len(data)} bytes {data[:BYTES_SHOWN].hex()}{more}>"


def _text(text: str) -> str:
    return json.dumps(text[:TEXT_SHOWN] + ("…" if len(text) > TEXT_SHOWN else ""),
                      ensure_ascii=False)


def _items(values) -> str:
    values = list(values)
    more = f" …+{len(values) - ITEMS_SHOWN}" if len(values) > ITEMS_SHOWN else ""
    return "[" + " ".join(str(v) for v in values[:ITEMS_SHOWN]) + more + "]"


def _time(timestamp_ms: int) -> str:
    moment = datetime.fromtimestamp(timestamp_ms / 1000, tz=timezone.utc)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")
