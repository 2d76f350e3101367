"""Export, stats and tail of recorded experience, on the embedded bus and on the real broker.

One small recorded run (`record_run`): four groups from two producers on three partitions, a
tampered record that does not decode, two weight announcements, and dead letters (two for the
tampered record, two about records outside the range). Every number checked below is worked out
by hand from that run.
"""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from miles.bus import Delivery, open_bus
from miles.cli import main
from miles.errors import ConfigError
from miles.experience import COLUMNS, export, stats, tail
from miles.experience import files
from miles.experience.stats import format_stats
from miles.protocol import TrajectoryGroup, encode
from miles.protocol.topics import run_topics, topic_name
from tests.conftest import unique_run
from tests.factories import (array_map, make_command, make_dead_letter, make_episode, make_group,
                             make_heartbeat, make_sample, make_weight_version, pack_map, wire_map)

STEP_S = 0.005  # between publishes: distinct millisecond timestamps keep the range order


def sample(versions: list[int], reward: float, finish: str = "stop", **overrides):
    return make_sample(len(versions), seed=len(versions) * 7 + int(reward * 100),
                       versions=np.array(versions, dtype=np.int32), reward=reward,
                       finish_reason=finish, **overrides)


GROUPS = {  # name: (partition, group)
    "a": (0, make_group(
        seed=1, group_id="ga", task_id="ta", producer_id="producer-0", engine="hf",
        samples=[sample([3, 3, 3, 3], 1.0),
                 sample([3, 3, 3, 3, 4, 4], 0.0, "length",
                        token_rewards=np.array([0, 0, 0, 0, 0, 0.5], dtype=np.float32))],
        sampling={"temperature": 1.0, "top_k": -1, "seed": 7},
        timings={"generate_s": 0.5, "reward_s": 0.25})),
    "b": (1, make_group(
        seed=2, group_id="gb", task_id="tb", producer_id="producer-1", engine="vllm",
        samples=[sample([3] * 2, 0.5), sample([3] * 8, 0.5),
                 sample([3] * 10, 1.0, "abort", error="reward timed out")],
        sampling={"temperature": 1.0, "top_k": -1, "seed": 7},
        timings={"generate_s": 1.5, "reward_s": 0.25}, reference=None)),
    "c": (2, make_group(
        seed=3, group_id="gc", task_id="tc", producer_id="producer-0", engine="hf",
        samples=[sample([5, 5, 5], 0.25), sample([5, 5, 6], 1.0)],
        sampling={"temperature": 0.7, "min_p": 0.05, "seed": 7},
        timings={"generate_s": 1.0, "queue_s": 2.0})),
    "d": (0, make_group(
        seed=4, group_id="gd", task_id="td", producer_id="producer-0", engine="hf",
        samples=[sample([3, 3, 4, 4, 5], 0.0, "length")],
        sampling={"temperature": 1.0, "seed": "abc"}, timings={})),
}


def tampered() -> bytes:
    """A well-formed msgpack group whose first sample has a NaN logprob."""
    wire = wire_map(make_group(seed=9, n_samples=1, n_tokens=4))
    wire["samples"][0]["logprobs"] = array_map([np.nan, -1.0, -1.0, -1.0], "<f4")
    return pack_map(wire)


@dataclass
class Recorded:
    run: str
    deliveries: dict[str, Delivery]  # group name (and "bad") -> where it landed


async def record_run(bus, run: str) -> Recorded:
    """v3 announced; groups a, b, the tampered record; v5 announced; groups c, d; letters."""
    trajectories, control = topic_name(run, "trajectories"), topic_name(run, "control")
    deliveries = {}

    async def put(topic: str, value: bytes, partition: int = 0) -> Delivery:
        delivery = await bus.publish(topic, value, partition=partition)
        await asyncio.sleep(STEP_S)
        return delivery

    await put(control, encode(make_weight_version(policy_version=3, step=3)))
    for name in ("a", "b"):
        deliveries[name] = await put(trajectories, encode(GROUPS[name][1]), GROUPS[name][0])
    deliveries["bad"] = await put(trajectories, tampered(), 1)
    await put(control, encode(make_command()))
    await put(control, encode(make_weight_version(policy_version=5, step=5)))
    for name in ("c", "d"):
        deliveries[name] = await put(trajectories, encode(GROUPS[name][1]), GROUPS[name][0])
    dlq = topic_name(run, "dlq")
    bad = deliveries["bad"]
    for reason in ("samples[0].logprobs: not finite", "seen again by another group"):
        await put(dlq, encode(make_dead_letter(reason=reason, source_topic=trajectories,
                                               source_partition=1, source_offset=bad.offset)))
    await put(dlq, encode(make_dead_letter(reason="outside", source_topic=trajectories,
                                           source_partition=0, source_offset=99)))
    prompts = topic_name(run, "prompts")
    await put(dlq, encode(make_dead_letter(reason="a prompt", source_topic=prompts,
                                           source_partition=1, source_offset=bad.offset)))
    return Recorded(run, deliveries)


def expected_rows(name: str, delivery: Delivery) -> list[dict]:
    """The rows of group `name`, written out field by field (without timestamp_ms)."""
    group: TrajectoryGroup = GROUPS[name][1]
    rows = []
    for index, s in enumerate(group.samples):
        rows.append({
            "topic": delivery.topic, "partition": delivery.partition, "offset": delivery.offset,
            "group_id": group.group_id, "task_id": group.task_id,
            "producer_id": group.producer_id, "engine": group.engine,
            "vocab_size": group.vocab_size, "reference": group.reference,
            "created_at": group.created_at, "prompt_token_ids": group.prompt_token_ids.tolist(),
            "prompt_length": len(group.prompt_token_ids), "group_size": len(group.samples),
            "group_min_version": min(int(x.versions.min()) for x in group.samples),
            "sample_index": index, "reward": s.reward, "finish_reason": s.finish_reason,
            "error": s.error, "response_token_ids": s.response_token_ids.tolist(),
            "logprobs": s.logprobs.tolist(), "versions": s.versions.tolist(),
            "token_rewards": None if s.token_rewards is None else s.token_rewards.tolist(),
            "response_length": len(s.versions), "min_version": int(s.versions.min()),
            "max_version": int(s.versions.max()),
            "loss_mask": None, "turn_ends": None, "turns": 1, "policy_length": len(s.versions),
            **{f"sampling_{k}": v for k, v in group.sampling.items()},
            **{f"timing_{k}": v for k, v in group.timings.items()},
        })
    return rows


def all_expected(recorded: Recorded) -> list[dict]:
    return [row for name in "abcd" for row in expected_rows(name, recorded.deliveries[name])]


async def test_export_jsonl_round_trips_every_field(bus, run, tmp_path):
    recorded = await record_run(bus, run)
    summary = await export(bus, run, "earliest", "latest", tmp_path / "run.jsonl")
    assert summary | {"seconds": 0} == {
        "out": str(tmp_path / "run.jsonl"), "format": "jsonl", "rows": 8, "records": 5,
        "groups": 4, "invalid": 1, "invalid_fields": {"samples[0].logprobs": 1}, "seconds": 0}
    lines = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    stamps = [row.pop("timestamp_ms") for row in lines]
    assert lines == all_expected(recorded)
    assert list(lines[0])[:len(COLUMNS) - 1] == [c for c in COLUMNS if c != "timestamp_ms"]
    assert stamps == sorted(stamps) and len(set(stamps)) == 4  # one per group, in order
    logprobs = np.array(lines[0]["logprobs"], dtype=np.float32)
    np.testing.assert_array_equal(logprobs, GROUPS["a"][1].samples[0].logprobs)
    assert not list(tmp_path.glob(".*"))  # no temporary file left behind


@pytest.mark.parametrize("batch_rows", [1000, 3])  # 3: parts with different schemas, merged
async def test_export_parquet_round_trips_every_field(bus, run, tmp_path, monkeypatch,
                                                      batch_rows):
    monkeypatch.setattr(files, "BATCH_ROWS", batch_rows)
    recorded = await record_run(bus, run)
    summary = await export(bus, run, "earliest", "latest", tmp_path / "run.parquet")
    assert (summary["rows"], summary["invalid"], summary["format"]) == (8, 1, "parquet")
    table = pq.read_table(tmp_path / "run.parquet")
    assert table.num_rows == 8
    assert table.schema.names[:len(COLUMNS)] == list(COLUMNS)
    types = {f.name: f.type for f in table.schema}
    assert types["response_token_ids"] == types["versions"] == pa.list_(pa.int32())
    assert types["logprobs"] == types["token_rewards"] == pa.list_(pa.float32())
    assert types["sampling_seed"] == pa.string()  # 7 in some groups, "abc" in another
    assert types["sampling_temperature"] == types["timing_queue_s"] == pa.float64()
    extras = sorted(set(table.schema.names) - set(COLUMNS))
    assert extras == ["sampling_min_p", "sampling_seed", "sampling_temperature",
                      "sampling_top_k", "timing_generate_s", "timing_queue_s", "timing_reward_s"]
    got = table.to_pylist()
    for row in got:
        row.pop("timestamp_ms")
    expected = [dict.fromkeys(extras) | row for row in all_expected(recorded)]
    for row in expected:
        row["sampling_seed"] = str(row["sampling_seed"])
    assert got == expected
    logprobs = table.column("logprobs").combine_chunks().values.to_numpy()
    np.testing.assert_array_equal(
        logprobs, np.concatenate([s.logprobs for n in "abcd" for s in GROUPS[n][1].samples]))
    assert not list(tmp_path.glob(".*"))


async def test_export_of_a_bounded_range(bus, run, tmp_path):
    recorded = await record_run(bus, run)
    summary = await export(bus, run, "1", "latest", tmp_path / "late.jsonl")
    assert (summary["records"], summary["rows"], summary["invalid"]) == (2, 1, 1)
    row = json.loads((tmp_path / "late.jsonl").read_text())
    assert (row["group_id"], row["offset"]) == ("gd", recorded.deliveries["d"].offset)


def test_export_format_and_missing_pyarrow_errors(tmp_path, monkeypatch):
    assert files.format_for(tmp_path / "x.PARQUET") == "parquet"
    assert files.format_for(tmp_path / "x.out", "jsonl") == "jsonl"
    with pytest.raises(ConfigError, match="cannot tell the export format"):
        files.format_for(tmp_path / "x.csv")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"pip install 'miles\[export\]'"):
        files.ParquetSink(tmp_path / "x.parquet")


async def test_stats_match_the_hand_computed_numbers(bus, run):
    await record_run(bus, run)
    summary = await stats(bus, run)
    assert (summary["records"], summary["groups"], summary["samples"]) == (5, 4, 8)
    assert summary["invalid"] == {"records": 1, "fields": {"samples[0].logprobs": 1}}
    # v3: 1, 0, .5, .5, 1, 0 (a, b, d); v5: .25, 1 (c)
    assert summary["reward"] == {"mean": 4.25 / 8, "errors": 1, "by_version": {
        3: {"samples": 6, "mean": 0.5}, 5: {"samples": 2, "mean": 0.625}}}
    # lengths 4 6 | 2 8 10 | 3 3 | 5 -> sorted 2 3 3 4 5 6 8 10
    assert summary["response_length"] == {"mean": 41 / 8, "p50": 4, "p95": 10, "max": 10}
    assert summary["finish_reasons"] == {"stop": 5, "length": 2, "abort": 1}
    assert summary["versions"] == {"min": 3, "max": 6, "samples_spanning_update": 3,
                                   "group_spread": {"groups": 4, "mean": 1.0, "max": 2,
                                                    "histogram": {0: 1, 1: 2, 2: 1}}}
    # a, b after v3 (lag 0); c, d after v5: c is v5 (0), d's oldest token is v3 (2)
    assert summary["lag"] == {"groups": 4, "mean": 0.5, "max": 2,
                              "histogram": {0: 3, 2: 1}, "unknown": 0}
    assert summary["producers"] == {
        "producer-0": {"groups": 3, "samples": 5, "engines": ["hf"]},
        "producer-1": {"groups": 1, "samples": 3, "engines": ["vllm"]}}
    assert summary["engines"] == {"hf": 3, "vllm": 1}
    assert summary["timings_mean_s"] == {"generate_s": 1.0, "queue_s": 2.0, "reward_s": 0.25}
    assert summary["dlq"] == {"records": 1,
                              "reasons": {"samples[0].logprobs: not finite": 1},
                              "failed_episodes": {"records": 0, "kinds": {}}}
    json.dumps(summary)  # JSON-ready as is


async def test_stats_of_a_bounded_range(bus, run):
    await record_run(bus, run)
    late = await stats(bus, run, "1", "latest")  # offset 1 of each partition: d and the bad one
    counted = (late["records"], late["groups"], late["samples"], late["dlq"]["records"])
    assert counted == (2, 1, 1, 1)
    early = await stats(bus, run, "earliest", "1")  # a, b, c: no dead letter belongs here
    assert (early["groups"], early["invalid"]["records"], early["dlq"]) == (
        3, 0, {"records": 0, "reasons": {}, "failed_episodes": {"records": 0, "kinds": {}}})


async def collect(lines, timeout_s: float = 60) -> list[str]:
    async def drain():
        return [line async for line in lines]
    return await asyncio.wait_for(drain(), timeout_s)


def by_location(lines: list[str]) -> dict[str, str]:
    return {line.split(" ", 1)[0]: line for line in lines}


async def test_tail_from_earliest_describes_groups_and_invalid_records(bus, run):
    recorded = await record_run(bus, run)
    lines = by_location(await collect(tail(bus, run, start="earliest", limit=5)))
    where = {name: f"{d.partition}@{d.offset}" for name, d in recorded.deliveries.items()}
    assert set(lines) == set(where.values())
    assert lines[where["a"]].endswith(
        " group ga task ta producer producer-0 (hf) v3..4 rewards [1 0] lengths [4 6] "
        "finish stop:1 length:1")
    assert lines[where["b"]].endswith(" rewards [0.5 0.5 1] lengths [2 8 10] "
                                      "finish stop:2 abort:1 reward_errors 1")
    assert " INVALID samples[0].logprobs: " in lines[where["bad"]]


async def test_tail_raw_shows_the_envelope_unchecked(bus, run):
    recorded = await record_run(bus, run)
    lines = by_location(await collect(tail(bus, run, raw=True, start="earliest", limit=5)))
    bad = recorded.deliveries["bad"]
    envelope = json.loads(lines[f"{bad.partition}@{bad.offset}"].split(" ", 2)[2])
    assert envelope["type"] == "trajectory_group"
    assert np.isnan(envelope["samples"][0]["logprobs"][0])  # shown, though decode refuses it
    a = recorded.deliveries["a"]
    group_a = json.loads(lines[f"{a.partition}@{a.offset}"].split(" ", 2)[2])
    assert group_a["samples"][1]["versions"] == [3, 3, 3, 3, 4, 4]
    assert group_a["samples"][1]["token_rewards"] == [0, 0, 0, 0, 0, 0.5]
    status = topic_name(run, "status")
    await bus.publish(status, encode(make_heartbeat()))
    await bus.publish(status, b"\xc1 not msgpack")
    raw = await collect(tail(bus, run, "status", raw=True, start="earliest", limit=2))
    assert json.loads(raw[0].split(" ", 2)[2])["extra"] == {"gpu": "cpu", "queue": 3}
    assert "INVALID record: not a valid msgpack record" in raw[1]


async def test_tail_follows_new_records_until_stopped(bus, run):
    await record_run(bus, run)  # control already holds v3, a command and v5: not shown
    ready, stop = asyncio.Event(), asyncio.Event()
    lines: list[str] = []

    async def follow():
        async for line in tail(bus, run, "control", stop=stop, ready=ready):
            lines.append(line)
            if len(lines) == 2:
                stop.set()

    following = asyncio.create_task(follow())
    await asyncio.wait_for(ready.wait(), 60)
    control = topic_name(run, "control")
    await bus.publish(control, encode(make_weight_version(policy_version=7, step=7)))
    await bus.publish(control, encode(make_command(command="drain", reason="maintenance")))
    await asyncio.wait_for(following, 60)
    assert " weight_version v7 step 7 lora 1234 bytes sha256 " in lines[0]
    assert lines[1].endswith(' command drain target * reason "maintenance"')


@pytest.mark.kafka
def test_cli_export_stats_and_tail_on_kafka(kafka_broker, tmp_path, capsys):
    run = unique_run()

    async def prepare():
        async with open_bus(kafka_broker.url) as bus:
            await bus.create_topics(run_topics(run, trajectory_partitions=3))
            await record_run(bus, run)

    asyncio.run(prepare())
    base = ["--bus", kafka_broker.url, "--run", run]
    assert main(["export", *base, "--out", str(tmp_path / "run.parquet")]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == 8
    assert pq.read_table(tmp_path / "run.parquet").num_rows == 8
    assert main(["export", *base, "--out", str(tmp_path / "run.jsonl"), "--from", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["invalid"] == 1
    assert len((tmp_path / "run.jsonl").read_text().splitlines()) == 1
    assert main(["stats", *base, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["groups"], summary["reward"]["by_version"]["5"]["mean"]) == (4, 0.625)
    assert main(["stats", *base]) == 0
    text = capsys.readouterr().out
    assert "8 samples, 1 invalid" in text and "v3: 0.5 (6), v5: 0.625 (2)" in text
    assert main(["tail", *base, "--from", "earliest", "--limit", "5"]) == 0
    assert capsys.readouterr().out.count(" group g") == 4
    assert main(["stats", "--bus", "embedded://", "--run", run]) == 2
    assert "the embedded bus lives inside one process" in capsys.readouterr().err


EPISODES = make_group(  # two episodes (1.4) and a single-turn sample, versions 3..4
    seed=5, group_id="ge", task_id="te", sampling={"max_new_tokens": 64}, timings={},
    samples=[make_episode([(2, 3), (1, 0)], seed=1, episode={"turns": 2, "tool_calls": 1,
                                                              "tool_errors": 1}),
             make_episode([(1, 4), (1, 2), (2, 0)], seed=2, episode={"tool_calls": 2}),
             sample([4, 4], 1.0)])


async def test_export_stats_and_tail_of_episodes(bus, run, tmp_path):
    await bus.publish(topic_name(run, "trajectories"), encode(EPISODES), partition=0)
    await export(bus, run, "earliest", "latest", tmp_path / "e.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "e.jsonl").read_text().splitlines()]
    shown = [(r["turns"], r["policy_length"], r["response_length"], r["loss_mask"],
              r["turn_ends"], r["min_version"], r["max_version"]) for r in rows]
    assert shown == [(2, 3, 6, [1, 1, 0, 0, 0, 1], [5, 6], 3, 4),
                     (3, 4, 10, [1, 0, 0, 0, 0, 1, 0, 0, 1, 1], [5, 8, 10], 3, 5),
                     (1, 2, 2, None, None, 4, 4)]
    assert rows[0]["episode_tool_errors"] == 1 and rows[1]["episode_tool_calls"] == 2
    assert rows[0]["versions"] == [3, 3, -1, -1, -1, 4]
    summary = await stats(bus, run)
    assert summary["episodes"] == {"samples": 2, "turns_mean": 2.5, "turns_max": 3,
                                   "observation_tokens": 3 + 6, "tool_calls": 3,
                                   "tool_errors": 1}
    assert summary["versions"]["min"] == 3  # not the observation tokens' -1
    assert "episodes          2 samples, turns mean 2.5 max 3, 9 observation tokens, 3 tool " \
           "calls, 1 tool errors" in format_stats(summary | {"topic": "t"})
    (line,) = await collect(tail(bus, run, start="earliest", limit=1))
    assert line.endswith(" turns [2 3 1] policy [3/6 4/10 2/2]"), line
    assert " v3..5 " in line
    (raw,) = await collect(tail(bus, run, start="earliest", limit=1, raw=True))
    assert '"loss_mask": [1, 1, 0, 0, 0, 1]' in raw
