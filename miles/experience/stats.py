"""`stats`: a summary of a range of a run's trajectories, and its text form.

What it reports: groups, samples and invalid records; reward mean by policy version (a sample's
version is its oldest token's); response lengths; finish reasons; how far responses span weight
updates; publish lag; producers and engines; mean timings; the dead letters of the range; and,
when the range holds multi-turn episodes (1.4), turns per episode, observation tokens, and the
tool calls and tool errors their `episode` maps count. Versions are the policy tokens'.

Choices:
- Publish lag of a group = the newest `policy_version` announced on the run's control topic at or
  before the group's timestamp, minus the group's min_version: how stale it was when it landed
  (the lag a trainer sees is larger by the time the group waited). Groups published before any
  announcement count as `unknown`. Timestamps come from different machines, so clock skew can
  shift it by one.
- Dead letters: the run's whole DLQ is read and a letter counts when its source is a record of
  this range (same trajectories partition, offset within what the range held). Every consumer
  group that rejects a record writes its own letter, so letters are counted once per source
  record, with the first letter's reason. The DLQ's own offsets or times say nothing about the
  range, so its bounds are not reused.
- Failed episodes (letters whose reason is `episode failed: <kind>: ...`, written by producers
  about the prompt an episode was played for) are counted by kind for the whole run, once per
  letter key: they never reached the trajectories topic, so nothing ties them to a range of
  it.
- Percentiles are nearest-rank over a histogram of lengths, so memory does not grow with the
  range.
"""

from __future__ import annotations

import bisect
import logging
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from itertools import accumulate

from miles.bus.base import Bus, Record
from miles.bus.ranges import Bound, parse_bound, read_range, reader_group
from miles.errors import CodecError
from miles.experience.rows import read_groups, turns
from miles.protocol import Command, DeadLetter, TrajectoryGroup, WeightVersion, decode
from miles.protocol.records import failed_episode_kind
from miles.protocol.topics import topic_name

log = logging.getLogger(__name__)

EVERYTHING = (parse_bound("earliest"), parse_bound("latest"))


async def stats(bus: Bus, run: str, start: Bound | str = "earliest",
                end: Bound | str = "latest") -> dict:
    """The summary of the run's trajectories in [start, end) (see the module docstring)."""
    topic = topic_name(run, "trajectories")
    summary = RangeSummary(announced=await announced_versions(bus, run))
    async for record, group in read_groups(bus, topic, parse_bound(start), parse_bound(end),
                                           group_id=reader_group(run, "stats"),
                                           invalid=summary.invalid):
        summary.add(record, group)
    letters = await dead_letters_of(bus, run, topic, summary.spans)
    return {"run": run, "topic": topic, **summary.as_dict(), "dlq": letters}


async def announced_versions(bus: Bus, run: str) -> list[tuple[int, int]]:
    """(timestamp_ms, policy_version) of every weight version on the control topic, in order."""
    topic = topic_name(run, "control")
    announced = []
    async for record in read_range(bus, topic, *EVERYTHING, group_id=reader_group(run, "stats")):
        try:
            value = decode(record.value, (WeightVersion, Command))
        except CodecError as err:
            log.warning("skipped invalid control record %s@%d: %s", topic, record.offset, err)
            continue
        if isinstance(value, WeightVersion):
            announced.append((record.timestamp_ms, value.policy_version))
    return announced


async def dead_letters_of(bus: Bus, run: str, topic: str,
                          spans: dict[int, tuple[int, int]]) -> dict:
    """{records, reasons}: dead letters whose source is a record of the range, once each;
    {failed_episodes: {records, kinds}}: the run's failed episodes by kind, once per key."""
    dlq = topic_name(run, "dlq")
    reasons: dict[tuple[int, int], str] = {}
    episodes: dict[bytes | None, str] = {}
    async for record in read_range(bus, dlq, *EVERYTHING, group_id=reader_group(run, "stats")):
        try:
            letter = decode(record.value, DeadLetter)
        except CodecError as err:
            log.warning("skipped invalid dead letter %s@%d: %s", dlq, record.offset, err)
            continue
        kind = failed_episode_kind(letter.reason)
        if kind is not None:
            episodes.setdefault(record.key or letter.key, kind)
            continue
        first, last = spans.get(letter.source_partition, (0, -1))
        if letter.source_topic == topic and first <= letter.source_offset <= last:
            reasons.setdefault((letter.source_partition, letter.source_offset), letter.reason)
    counted = Counter(reasons.values())
    kinds = Counter(episodes.values())
    return {"records": len(reasons), "reasons": dict(counted.most_common()),
            "failed_episodes": {"records": len(episodes), "kinds": dict(kinds.most_common())}}


@dataclass
class RangeSummary:
    """Running totals over the records of a range; `as_dict` is the report."""

    announced: list[tuple[int, int]]  # (timestamp_ms, policy_version) from the control topic
    records: int = 0
    groups: int = 0
    invalid: Counter[str] = field(default_factory=Counter)
    spans: dict[int, tuple[int, int]] = field(default_factory=dict)  # partition -> offsets
    rewards: dict[int, list] = field(default_factory=lambda: defaultdict(lambda: [0, 0.0]))
    lengths: Counter[int] = field(default_factory=Counter)
    finish_reasons: Counter[str] = field(default_factory=Counter)
    reward_errors: int = 0
    oldest: int | None = None  # token versions seen
    newest: int | None = None
    spreads: Counter[int] = field(default_factory=Counter)
    spanning_samples: int = 0
    lags: Counter[int] = field(default_factory=Counter)
    lag_unknown: int = 0
    producers: dict[str, dict] = field(default_factory=dict)
    engines: Counter[str] = field(default_factory=Counter)
    timings: dict[str, list] = field(default_factory=lambda: defaultdict(lambda: [0, 0.0]))
    turns: Counter[int] = field(default_factory=Counter)  # turns per episode (1.4)
    episode_counts: Counter[str] = field(default_factory=Counter)  # tool_calls, tool_errors, ...

    def __post_init__(self) -> None:
        self.announced = sorted(self.announced)
        self.announce_times = [t for t, _ in self.announced]
        self.newest_announced = list(accumulate((v for _, v in self.announced), max))

    def add(self, record: Record, group: TrajectoryGroup | None) -> None:
        self.records += 1
        first, last = self.spans.get(record.partition, (record.offset, record.offset))
        self.spans[record.partition] = (min(first, record.offset), max(last, record.offset))
        if group is None:
            return
        self.groups += 1
        producer = self.producers.setdefault(group.producer_id,
                                             {"groups": 0, "samples": 0, "engines": set()})
        producer["groups"] += 1
        producer["samples"] += len(group.samples)
        producer["engines"].add(group.engine)
        self.engines[group.engine] += 1
        for key, seconds in group.timings.items():
            self.timings[key][0] += 1
            self.timings[key][1] += seconds
        self._add_versions(record, group)
        for sample in group.samples:
            versions = sample.policy_versions
            oldest, newest = int(versions.min()), int(versions.max())
            self.rewards[oldest][0] += 1
            self.rewards[oldest][1] += sample.reward
            self.lengths[len(sample.response_token_ids)] += 1
            self.finish_reasons[sample.finish_reason] += 1
            self.reward_errors += sample.error is not None
            self.spanning_samples += oldest != newest
            if sample.loss_mask is not None:
                self._add_episode(sample)

    def _add_episode(self, sample) -> None:
        self.turns[turns(sample)] += 1
        self.episode_counts["observation_tokens"] += \
            len(sample.response_token_ids) - sample.policy_tokens
        for key in ("tool_calls", "tool_errors"):
            value = sample.episode.get(key)
            if type(value) is int:
                self.episode_counts[key] += value

    def _add_versions(self, record: Record, group: TrajectoryGroup) -> None:
        newest = max(int(s.versions.max()) for s in group.samples)
        if self.oldest is None:
            self.oldest, self.newest = group.min_version, newest
        self.oldest, self.newest = min(self.oldest, group.min_version), max(self.newest, newest)
        self.spreads[newest - group.min_version] += 1
        known = bisect.bisect_right(self.announce_times, record.timestamp_ms)
        if known == 0:
            self.lag_unknown += 1
        else:
            self.lags[group.lag(self.newest_announced[known - 1])] += 1

    def as_dict(self) -> dict:
        samples = self.lengths.total()
        reward_sum = sum(total for _, total in self.rewards.values())
        return {
            "records": self.records, "groups": self.groups, "samples": samples,
            "invalid": {"records": self.invalid.total(), "fields": dict(self.invalid)},
            "reward": {"mean": reward_sum / samples if samples else None,
                       "errors": self.reward_errors,
                       "by_version": {v: {"samples": n, "mean": total / n}
                                      for v, (n, total) in sorted(self.rewards.items())}},
            "response_length": {"mean": mean_of(self.lengths), "p50": percentile(self.lengths, 50),
                                "p95": percentile(self.lengths, 95),
                                "max": max(self.lengths, default=None)},
            "finish_reasons": dict(self.finish_reasons.most_common()),
            "versions": {"min": self.oldest, "max": self.newest,
                         "samples_spanning_update": self.spanning_samples,
                         "group_spread": histogram_summary(self.spreads)},
            "lag": {**histogram_summary(self.lags), "unknown": self.lag_unknown},
            "producers": {pid: {**p, "engines": sorted(p["engines"])}
                          for pid, p in sorted(self.producers.items())},
            "engines": dict(self.engines.most_common()),
            "timings_mean_s": {k: total / n for k, (n, total) in sorted(self.timings.items())},
            "episodes": {"samples": self.turns.total(), "turns_mean": mean_of(self.turns),
                         "turns_max": max(self.turns, default=None),
                         "observation_tokens": self.episode_counts["observation_tokens"],
                         "tool_calls": self.episode_counts["tool_calls"],
                         "tool_errors": self.episode_counts["tool_errors"]},
        }


def histogram_summary(histogram: Counter[int]) -> dict:
    return {"groups": histogram.total(), "mean": mean_of(histogram),
            "max": max(histogram, default=None), "histogram": dict(sorted(histogram.items()))}


def mean_of(histogram: Counter[int]) -> float | None:
    count = histogram.total()
    return sum(k * n for k, n in histogram.items()) / count if count else None


def percentile(histogram: Counter[int], q: int) -> int | None:
    """Nearest rank: the smallest value with at least q% of the counts at or below it."""
    rank = max(1, (q * histogram.total() + 99) // 100)
    seen = 0
    for value in sorted(histogram):
        seen += histogram[value]
        if seen >= rank:
            return value
    return None  # an empty histogram


def format_stats(summary: dict) -> str:
    """The summary as a few aligned lines for a terminal."""
    reward, length, versions, lag = (summary[k] for k in
                                     ("reward", "response_length", "versions", "lag"))
    invalid = summary["invalid"]
    lines = [
        f"{summary['topic']}: {summary['records']} records, {summary['groups']} groups, "
        f"{summary['samples']} samples, {invalid['records']} invalid"
        + (f" ({_pairs(invalid['fields'])})" if invalid["records"] else ""),
        f"reward            mean {_num(reward['mean'])}, {reward['errors']} reward errors",
        "  by version      " + (", ".join(f"v{label}: {_num(mean)} ({n})" for label, mean, n
                                          in _version_bins(reward["by_version"])) or "-"),
        f"response length   mean {_num(length['mean'])}, p50 {length['p50']}, "
        f"p95 {length['p95']}, max {length['max']}",
        f"finish reasons    {_pairs(summary['finish_reasons']) or '-'}",
        f"versions          {versions['min']}..{versions['max']}, "
        f"{versions['samples_spanning_update']} samples span an update, group spread mean "
        f"{_num(versions['group_spread']['mean'])} max {versions['group_spread']['max']}",
        f"publish lag       mean {_num(lag['mean'])}, max {lag['max']}, "
        f"groups by lag {_pairs(lag['histogram']) or '-'}, unknown {lag['unknown']}",
        "producers",
        *(f"  {pid:<16}{p['groups']} groups, {p['samples']} samples, {', '.join(p['engines'])}"
          for pid, p in summary["producers"].items()),
        f"timings (mean s)  {_pairs({k: _num(v) for k, v in summary['timings_mean_s'].items()})}",
        *_episode_lines(summary["episodes"]),
        f"dead letters      {summary['dlq']['records']} records of this range",
        *(f"  {n:>5}  {reason}" for reason, n in summary["dlq"]["reasons"].items()),
        *_failed_lines(summary["dlq"]["failed_episodes"]),
    ]
    return "\n".join(lines)


def _failed_lines(failed: dict) -> list[str]:
    if not failed["records"]:
        return []
    return [f"failed episodes   {failed['records']} ({_pairs(failed['kinds'])}) in the "
            f"run's DLQ, never trained"]


def _episode_lines(episodes: dict) -> list[str]:
    if not episodes["samples"]:
        return []
    return [f"episodes          {episodes['samples']} samples, turns mean "
            f"{_num(episodes['turns_mean'])} max {episodes['turns_max']}, "
            f"{episodes['observation_tokens']} observation tokens, {episodes['tool_calls']} tool "
            f"calls, {episodes['tool_errors']} tool errors"]


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _pairs(counts: dict) -> str:
    return ", ".join(f"{k}: {v}" for k, v in counts.items())


def _version_bins(by_version: dict, most: int = 10) -> list[tuple[str, float, int]]:
    """(versions label, mean reward, samples) per version, or per range of consecutive versions
    when there are more than `most` (the --json output keeps every version)."""
    items = sorted((int(v), r["mean"], r["samples"]) for v, r in by_version.items())
    size = max(1, -(-len(items) // most))
    bins = []
    for start in range(0, len(items), size):
        chunk = items[start:start + size]
        samples = sum(n for _, _, n in chunk)
        mean = sum(m * n for _, m, n in chunk) / max(samples, 1)
        first, last = chunk[0][0], chunk[-1][0]
        bins.append((str(first) if first == last else f"{first}-{last}", mean, samples))
    return bins
