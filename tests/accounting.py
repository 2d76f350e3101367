"""What the delivery tests share: numbered trajectory groups on two partitions, and the
exactly-once check of a trainer's ledger against what was published."""

from __future__ import annotations

import json
from pathlib import Path

from miles.protocol import encode
from miles.protocol.topics import topic_name
from tests.factories import make_group

TINY_VOCAB_SIZE = 78  # the tiny test model's vocabulary: the trainer rejects any other


def ledger(out: Path) -> list[dict]:
    path = Path(out) / "ledger.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line] \
        if path.exists() else []


async def publish_numbered(bus, run: str, first: int, count: int) -> list[str]:
    """Groups `group-<first>`.. on trajectory partition i % 2 (of two); their ids in order."""
    ids = []
    for i in range(first, first + count):
        group = make_group(n_samples=4, n_tokens=3, prompt_tokens=4, vocab_size=TINY_VOCAB_SIZE,
                           policy_version=0, seed=i, group_id=f"group-{i:03d}")
        await bus.publish(topic_name(run, "trajectories"), encode(group), partition=i % 2)
        ids.append(group.group_id)
    return ids


def assert_trained_once(entries: list[dict], published: list[str], *, steps: int,
                        per_step: int) -> list[str]:
    """Steps 1..`steps` once each, no group trained twice, and per partition the trained groups
    a prefix of what was published (none skipped). Returns the trained ids."""
    assert [e["step"] for e in entries] == list(range(1, steps + 1))
    trained = [g for e in entries for g in e["trained"]]
    assert len(trained) == len(set(trained)) == per_step * steps, "a group was trained twice"
    for parity in (0, 1):
        sent = [g for i, g in enumerate(published) if i % 2 == parity]
        got = [g for g in trained if int(g.split("-")[1]) % 2 == parity]
        assert sorted(got) == sent[:len(got)], "a group was skipped"
    return trained
