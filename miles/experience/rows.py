"""Trajectory groups as rows (one per sample), and the range reader export and stats share.

A row holds every field of a sample and of its group (group fields repeat on each of the
group's rows), where the record sat on the bus, and a few derived values (lengths, version
range). The fixed columns are `COLUMNS`; the open-ended maps are flattened after them:
`sampling` key `k` becomes column `sampling_k`, `timings` key `k` becomes `timing_k`, a sample's
`episode` key `k` (1.4) becomes `episode_k`. An episode's row has its `loss_mask` and
`turn_ends`; `turns` (1 for a single-turn sample) and `policy_length` (its policy tokens) are
derived, and the version range is that of the policy's tokens.

Simplifications:
- Arrays stay numpy arrays (read-only views over the decoded record): each writer converts them
  its own way, and nothing is copied into Python lists twice.
- An invalid record in a range is logged, counted under the field the codec names and skipped:
  an export or a summary never stops on bad data (the DLQ keeps the details).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import AsyncIterator

import numpy as np

from miles.bus.base import Bus, Record
from miles.bus.ranges import Bound, read_range
from miles.errors import CodecError
from miles.protocol import Sample, TrajectoryGroup, decode

log = logging.getLogger(__name__)

COLUMNS: dict[str, str] = {
    # where the record sat on the bus
    "topic": "str", "partition": "int", "offset": "int", "timestamp_ms": "int",
    # the group, repeated on each of its rows
    "group_id": "str", "task_id": "str", "producer_id": "str", "engine": "str",
    "vocab_size": "int", "reference": "str", "created_at": "float",
    "prompt_token_ids": "ints", "prompt_length": "int", "group_size": "int",
    "group_min_version": "int",
    # the sample
    "sample_index": "int", "reward": "float", "finish_reason": "str", "error": "str",
    "response_token_ids": "ints", "logprobs": "floats", "versions": "ints",
    "token_rewards": "floats", "response_length": "int", "min_version": "int",
    "max_version": "int",
    # an episode's (1.4); null for a single-turn sample but turns (1) and policy_length (T)
    "loss_mask": "ints", "turn_ends": "ints", "turns": "int", "policy_length": "int",
}
"""Fixed columns in order, with their kind: str, int, float, ints (int32 array), floats
(float32 array). `reference`, `error`, `token_rewards`, `loss_mask` and `turn_ends` may be null,
and the location columns are null in rows built without a record."""

SAMPLING_PREFIX = "sampling_"
TIMING_PREFIX = "timing_"
EPISODE_PREFIX = "episode_"


def rows(group: TrajectoryGroup, record: Record | None = None) -> list[dict]:
    """One row per sample of `group`, keys in `COLUMNS` order then the flattened maps;
    the location columns are None without `record`."""
    where = dict.fromkeys(("topic", "partition", "offset", "timestamp_ms"))
    if record is not None:
        where = {"topic": record.topic, "partition": record.partition,
                 "offset": record.offset, "timestamp_ms": record.timestamp_ms}
    extras = {f"{SAMPLING_PREFIX}{k}": v for k, v in group.sampling.items()}
    extras.update({f"{TIMING_PREFIX}{k}": v for k, v in group.timings.items()})
    out = []
    for index, sample in enumerate(group.samples):
        row = {
            **where,
            "group_id": group.group_id, "task_id": group.task_id,
            "producer_id": group.producer_id, "engine": group.engine,
            "vocab_size": group.vocab_size, "reference": group.reference,
            "created_at": group.created_at, "prompt_token_ids": group.prompt_token_ids,
            "prompt_length": len(group.prompt_token_ids), "group_size": len(group.samples),
            "group_min_version": group.min_version,
            "sample_index": index, "reward": sample.reward,
            "finish_reason": sample.finish_reason, "error": sample.error,
            "response_token_ids": sample.response_token_ids, "logprobs": sample.logprobs,
            "versions": sample.versions, "token_rewards": sample.token_rewards,
            "response_length": len(sample.response_token_ids),
            "min_version": int(sample.policy_versions.min()),
            "max_version": int(sample.policy_versions.max()),
            "loss_mask": None if sample.loss_mask is None else sample.loss_mask.astype(np.int32),
            "turn_ends": sample.turn_ends, "turns": turns(sample),
            "policy_length": sample.policy_tokens,
        }
        episode = {f"{EPISODE_PREFIX}{k}": v for k, v in sample.episode.items()}
        out.append(row | extras | episode)
    return out


def turns(sample: Sample) -> int:
    """Turns of a sample: its `turn_ends`, else the `episode` map's int `turns`, else 1."""
    if sample.turn_ends is not None:
        return len(sample.turn_ends)
    recorded = sample.episode.get("turns")
    return recorded if type(recorded) is int and recorded > 0 else 1


async def read_groups(bus: Bus, topic: str, start: Bound, end: Bound, *, group_id: str,
                      invalid: Counter[str], counts: dict | None = None
                      ) -> AsyncIterator[tuple[Record, TrajectoryGroup | None]]:
    """Every record of the range with its group, or None (counted in `invalid` under the
    field the codec names, and logged) when it does not decode as a `TrajectoryGroup`."""
    async for record in read_range(bus, topic, start, end, group_id=group_id, counts=counts):
        try:
            group = decode(record.value, TrajectoryGroup)
        except CodecError as err:
            invalid[err.field] += 1
            log.warning("skipped invalid record %s[%d]@%d: %s", record.topic, record.partition,
                        record.offset, err)
            group = None
        yield record, group
