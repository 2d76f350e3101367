"""`status`: a run at a glance, from its status topic and the offsets of its topics.

What it reports: each producer (engine, loaded policy version, in-flight groups, throughput,
paused, last error, what its admission waits for, a streaming producer's metrics) and the
trainer (policy version, step, step rate, backlog, stale drops, lag histogram of the groups it
trained), from the heartbeats of the last `window_s` seconds; the lag
of every consumer group that committed on the run's topics; the records each topic holds,
the DLQ's among them.

Choices:
- Heartbeats carry running totals (a producer's `groups` and `tokens`; the trainer's `step`,
  `trainer/*` counts and `lag/<n>` histogram). A rate is the change between a sender's oldest
  and newest heartbeat in the window, over their `created_at` gap, counted from its last
  restart (a total that went down); with fewer than two heartbeats it is unknown, except a
  producer's tokens/s, which falls back to the lifetime mean its heartbeat carries. The lag
  histogram is that same change: the groups trained within the window.
- A sender is live while its newest heartbeat is younger than `stale_s`, or three of its own
  heartbeat periods (the median gap in the window) when those are longer; otherwise stale.
  A sender silent for the whole window is not seen at all. Ages use the sender's clock.
- Consumer lag = end offset - committed offset, summed over the partitions a group committed.
  Groups that commit nothing (range readers, including this one) are not listed. The trainer
  commits only when it stops, so its live backlog comes from its heartbeat: trajectory records
  published minus records it has consumed.
- Read-only: heartbeats are read in a fresh consumer group that commits nothing; a record that
  is not a valid heartbeat is counted, not dead-lettered.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter, defaultdict
from datetime import datetime, timezone

from miles.bus.base import Bus, TopicPartition
from miles.bus.ranges import Bound, RangeError, read_range, reader_group
from miles.errors import CodecError
from miles.protocol import Heartbeat, decode
from miles.protocol.topics import KINDS, topic_name

WINDOW_S = 60.0  # heartbeats read: the last minute
STALE_S = 15.0  # a sender whose newest heartbeat is older is stale...
STALE_PERIODS = 3  # ...unless this many of its own heartbeat periods have not passed yet
LAG_PREFIX = "lag/"  # trainer heartbeat keys `lag/<n>`: groups trained at lag n, running total


async def collect_status(bus: Bus, run: str, *, window_s: float = WINDOW_S,
                         stale_s: float = STALE_S, now: float | None = None) -> dict:
    """The run's status (see the module docstring) from heartbeats of the last `window_s` s;
    `now` (unix seconds) is when ages are measured from, by default the current time."""
    now = time.time() if now is None else now
    offsets = await bus.topic_offsets([topic_name(run, kind) for kind in KINDS])  # run exists?
    beats, invalid = await recent_heartbeats(bus, run, since_ms=int((now - window_s) * 1000))
    senders: dict[str, list[Heartbeat]] = defaultdict(list)
    for beat in sorted(beats, key=lambda b: b.created_at):
        senders[beat.producer_id].append(beat)
    records = {kind: sum(end - first for tp, (first, end) in offsets.items()
                         if tp.topic == topic_name(run, kind)) for kind in KINDS}
    published = sum(end for tp, (_, end) in offsets.items()
                    if tp.topic == topic_name(run, "trajectories"))
    producers = [producer_status(b, now, stale_s) for _, b in sorted(senders.items())
                 if b[-1].role == "producer"]
    trainers = [b for b in senders.values() if b[-1].role == "trainer"]
    trainer = (trainer_status(max(trainers, key=lambda b: b[-1].created_at), now, stale_s,
                              published) if trainers else None)
    return {"run": run, "time": now, "window_s": window_s, "producers": producers,
            "trainer": trainer, "consumer_lag": await consumer_lag(bus, run, offsets),
            "records": records, "dlq_records": records["dlq"], "invalid_heartbeats": invalid}


async def recent_heartbeats(bus: Bus, run: str, *, since_ms: int) -> tuple[list[Heartbeat], int]:
    """The heartbeats published at or after `since_ms`, and how many records were invalid."""
    topic = topic_name(run, "status")
    try:
        return await _heartbeats(bus, run, topic, Bound("time", since_ms))
    except RangeError:  # retention deleted older records: everything it kept is in the window
        return await _heartbeats(bus, run, topic, Bound("earliest"))


async def _heartbeats(bus: Bus, run: str, topic: str, start: Bound
                      ) -> tuple[list[Heartbeat], int]:
    beats, invalid = [], 0
    async for record in read_range(bus, topic, start, Bound("latest"),
                                   group_id=reader_group(run, "status")):
        try:
            beats.append(decode(record.value, Heartbeat))
        except CodecError:
            invalid += 1
    return beats, invalid


def producer_status(beats: list[Heartbeat], now: float, stale_s: float) -> dict:
    """One producer from its heartbeats in the window, oldest first."""
    last, since = beats[-1], since_restart(beats, ("groups", "tokens"))
    tokens_per_s = rate(since, "tokens")
    errors = [b.extra["error"] for b in beats if isinstance(b.extra.get("error"), str)]
    return {"id": last.producer_id, "engine": last.engine,
            "policy_version": last.policy_version, "in_flight": last.in_flight,
            "tokens_per_s": last.tokens_per_s if tokens_per_s is None else tokens_per_s,
            "groups_per_s": rate(since, "groups"), "groups": count(last, "groups"),
            "paused": last.extra.get("paused") is True, "weight_errors":
            count(last, "weight_errors"), "last_error": errors[-1] if errors else None,
            "waiting": last.extra.get("waiting") if isinstance(last.extra.get("waiting"), str)
            else None,
            "stream": {key: count(last, key) for key in STREAM_METRICS
                       if count(last, key) is not None},
            "refused": {key: count(last, key) for key in REFUSED_PROMPTS if count(last, key)},
            **liveness(beats, now, stale_s)}


def trainer_status(beats: list[Heartbeat], now: float, stale_s: float, published: int) -> dict:
    """The trainer from its heartbeats in the window, oldest first; `published` = trajectory
    records on the bus (end offsets summed)."""
    last, since = beats[-1], since_restart(beats, ("step", "trainer/groups_trained"))
    consumed = count(last, "consumed")
    return {"id": last.producer_id, "policy_version": last.policy_version,
            "step": count(last, "step"), "steps_per_s": rate(since, "step"),
            "groups_per_s": rate(since, "trainer/groups_trained"),
            "consumed": consumed, "backlog": None if consumed is None else published - consumed,
            **{key: count(last, f"trainer/{key}")
               for key in ("groups_trained", "dropped_stale", "filtered_groups",
                           "regenerated_groups", "dead_lettered")},
            "lag_histogram": _sorted(lag_histogram(since[-1]) - lag_histogram(since[0])),
            "lag_histogram_total": _sorted(lag_histogram(last)),
            **liveness(beats, now, stale_s)}


def count(beat: Heartbeat, key: str) -> int | float | None:
    """A numeric value of the heartbeat's `extra` (None when absent or not a number)."""
    value = beat.extra.get(key)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def since_restart(beats: list[Heartbeat], keys: tuple[str, ...]) -> list[Heartbeat]:
    """The heartbeats from the sender's last restart on: after the last total that went down."""
    start = 0
    for i in range(1, len(beats)):
        for key in keys:
            before, after = count(beats[i - 1], key), count(beats[i], key)
            if before is not None and after is not None and after < before:
                start = i
    return beats[start:]


def rate(beats: list[Heartbeat], key: str) -> float | None:
    """Change per second of the running total `key` from the first to the last heartbeat."""
    first, last = count(beats[0], key), count(beats[-1], key)
    elapsed = beats[-1].created_at - beats[0].created_at
    if first is None or last is None or elapsed <= 0:
        return None
    return (last - first) / elapsed


def lag_histogram(beat: Heartbeat) -> Counter[int]:
    """{lag: groups trained at that lag} from the trainer heartbeat's `lag/<n>` totals."""
    histogram: Counter[int] = Counter()
    for key in beat.extra:
        groups = count(beat, key)
        if key.startswith(LAG_PREFIX) and key[len(LAG_PREFIX):].lstrip("-").isdigit() and groups:
            histogram[int(key[len(LAG_PREFIX):])] = int(groups)
    return histogram


def _sorted(histogram: Counter[int]) -> dict[int, int]:
    return dict(sorted(histogram.items()))


def liveness(beats: list[Heartbeat], now: float, stale_s: float) -> dict:
    """{age_s, live}: seconds since the newest heartbeat, and whether that is recent enough."""
    gaps = [b.created_at - a.created_at for a, b in zip(beats, beats[1:])]
    period = statistics.median(gaps) if gaps else 0.0
    age = round(now - beats[-1].created_at, 3)
    return {"age_s": age, "live": age <= max(stale_s, STALE_PERIODS * period)}


async def consumer_lag(bus: Bus, run: str,
                       offsets: dict[TopicPartition, tuple[int, int]]) -> dict[str, dict]:
    """group id -> topic kind -> {lag, committed_partitions, partitions}."""
    kinds = {topic_name(run, kind): kind for kind in KINDS}
    partitions = Counter(kinds[tp.topic] for tp in offsets)
    lag: dict[str, dict] = {}
    for group, committed in sorted((await bus.group_offsets(kinds)).items()):
        for tp, offset in committed.items():
            if tp not in offsets:  # a partition added since the offsets were read
                continue
            entry = lag.setdefault(group, {}).setdefault(kinds[tp.topic], {
                "lag": 0, "committed_partitions": 0, "partitions": partitions[kinds[tp.topic]]})
            entry["lag"] += offsets[tp][1] - offset
            entry["committed_partitions"] += 1
    return lag


# -- text form -------------------------------------------------------------------------------

# a streaming producer's heartbeat metrics (`miles.rollout_stream`, docs/streaming.md)
STREAM_METRICS = ("busy_fraction", "generated_tokens_per_s", "in_flight_groups",
                  "mixed_sample_share", "tokens_wasted", "restarted_groups",
                  "first_token_after_version_s", "length_p50", "length_p90", "length_max")
# prompts a producer dead-lettered instead of generating (longer than the engine's context or
# refused by it; undecodable or invalid)
REFUSED_PROMPTS = ("rejected_prompts", "bad_prompts")
PRODUCER_COLUMNS = ("producer", "engine", "version", "in_flight", "tokens/s", "groups/s",
                    "groups", "state", "seen")


def format_status(status: dict) -> str:
    """The status as a few plain-text lines and a producer table."""
    moment = datetime.fromtimestamp(status["time"], tz=timezone.utc)
    lines = [f"run {status['run']} at {moment.isoformat(timespec='seconds')} "
             f"(heartbeats of the last {status['window_s']:g} s)"]
    producers = status["producers"]
    live = sum(p["live"] for p in producers)
    lines.append(f"producers: {live} live, {len(producers) - live} stale")
    if producers:
        lines.extend(_table(PRODUCER_COLUMNS, [_producer_row(p) for p in producers]))
    lines.extend(f"  {p['id']}: last error: {p['last_error']}"
                 for p in producers if p["last_error"])
    lines.extend(f"  {p['id']}: waiting for {p['waiting']}" for p in producers if p["waiting"])
    lines.extend(f"  {p['id']}: streaming " + ", ".join(f"{k} {v:g}"
                                                       for k, v in p["stream"].items())
                 for p in producers if p["stream"])
    lines.extend(f"  {p['id']}: prompts dead-lettered: " + ", ".join(
        f"{k} {v:g}" for k, v in p["refused"].items()) for p in producers if p["refused"])
    lines.extend(_trainer_lines(status["trainer"]))
    lines.append("consumer lag (end - committed offset):")
    for group, topics in status["consumer_lag"].items():
        lines.append(f"  {group}: " + ", ".join(
            f"{kind} {entry['lag']}" + ("" if entry["committed_partitions"] == entry["partitions"]
                                        else f" ({entry['committed_partitions']}/"
                                             f"{entry['partitions']} partitions)")
            for kind, entry in topics.items()))
    if not status["consumer_lag"]:
        lines.append("  (no group has committed offsets)")
    lines.append("records: " + ", ".join(f"{k} {n}" for k, n in status["records"].items()))
    lines.append(f"dlq: {status['dlq_records']} records")
    if status["invalid_heartbeats"]:
        lines.append(f"invalid status records: {status['invalid_heartbeats']}")
    return "\n".join(lines)


def _producer_row(p: dict) -> list[str]:
    state = ("live" if p["live"] else "stale") + (" paused" if p["paused"] else "")
    return [p["id"], p["engine"] or "-", f"v{p['policy_version']}", str(p["in_flight"]),
            _number(p["tokens_per_s"], 1), _number(p["groups_per_s"], 2),
            _number(p["groups"], 0), state, f"{p['age_s']:.1f}s ago"]


def _trainer_lines(t: dict | None) -> list[str]:
    if t is None:
        return ["trainer: no heartbeat in the window"]
    state = "live" if t["live"] else "stale"
    histogram = " ".join(f"{lag}:{n}" for lag, n in sorted(t["lag_histogram"].items()))
    return [f"trainer {t['id']}: v{t['policy_version']} step {_number(t['step'], 0)}, "
            f"{state} (seen {t['age_s']:.1f}s ago)",
            f"  {_number(t['steps_per_s'], 2)} steps/s, {_number(t['groups_per_s'], 2)} groups/s,"
            f" backlog {_number(t['backlog'], 0)} records, dropped stale "
            f"{_number(t['dropped_stale'], 0)}, dead-lettered {_number(t['dead_lettered'], 0)}",
            f"  lag of groups trained in the window (lag:groups): {histogram or '-'}"]


def _number(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _table(header: tuple[str, ...], rows: list[list[str]]) -> list[str]:
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    return ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
            for row in (list(header), *rows)]
