"""`miles smoke`: push trajectory groups through a bus and back, the way a run will.

Creates a fresh run's topics, publishes `groups` encoded `TrajectoryGroup`s (8 samples x 256
tokens each) plus one deliberately corrupt record, consumes the topic as a trainer would through a
`DecodingConsumer`, and reports throughput and what reached the DLQ. Exits non-zero unless every
group came back intact and exactly the corrupt record was dead-lettered.
"""

from __future__ import annotations

import time
import uuid

import numpy as np

from miles.bus import open_bus
from miles.bus.decoding import DecodingConsumer
from miles.protocol import DeadLetter, Sample, TrajectoryGroup, decode, encode
from miles.protocol.topics import run_topics, topic_name

VOCAB_SIZE = 32_000
POLL_TIMEOUT_S = 60.0


def synthetic_group(index: int, *, n_samples: int = 8, n_tokens: int = 256,
                    prompt_tokens: int = 64, vocab_size: int = VOCAB_SIZE) -> TrajectoryGroup:
    """A valid group with random tokens and logprobs, for smoke runs and benchmarks."""
    rng = np.random.default_rng(index)
    samples = [Sample(response_token_ids=rng.integers(0, vocab_size, n_tokens, dtype=np.int32),
                      logprobs=-rng.exponential(1.0, n_tokens).astype(np.float32),
                      versions=np.zeros(n_tokens, dtype=np.int32),
                      reward=float(rng.integers(0, 2)), finish_reason="stop")
               for _ in range(n_samples)]
    return TrajectoryGroup(
        group_id=f"smoke-{index}", task_id=f"task-{index}",
        prompt_token_ids=rng.integers(0, vocab_size, prompt_tokens, dtype=np.int32),
        samples=samples, producer_id="smoke", engine="synthetic", vocab_size=vocab_size,
        sampling={"temperature": 1.0}, created_at=time.time())


async def run_smoke(url: str, *, groups: int = 200) -> dict:
    run = f"smoke-{uuid.uuid4().hex[:8]}"
    trajectories, dlq = topic_name(run, "trajectories"), topic_name(run, "dlq")
    async with open_bus(url) as bus:
        await bus.create_topics(run_topics(run, trajectory_partitions=4))
        payloads = [encode(synthetic_group(i)) for i in range(groups)]
        started = time.perf_counter()
        pending = [await bus.send(trajectories, p, key=str(i).encode())
                   for i, p in enumerate(payloads)]
        pending.append(await bus.send(trajectories, payloads[0][: len(payloads[0]) // 2],
                                      key=b"corrupt"))
        for delivery in pending:
            await delivery
        await bus.flush()
        published_s = time.perf_counter() - started

        seen: set[str] = set()
        async with bus.consumer([trajectories], group_id=f"{run}-trainer") as consumer:
            reader = DecodingConsumer(bus, consumer, dlq_topic=dlq, expected=TrajectoryGroup)
            deadline = time.monotonic() + POLL_TIMEOUT_S
            while (len(seen) < groups or not reader.counts["bus/dlq_records"]) \
                    and time.monotonic() < deadline:
                seen.update(d.value.group_id for d in await reader.poll(timeout_s=0.5))
            await consumer.commit()
        total_s = time.perf_counter() - started
        letters = await _read_dead_letters(bus, dlq, run)

    megabytes = sum(map(len, payloads)) / 1e6
    return {
        "bus": url, "run": run, "groups_published": groups, "groups_consumed": len(seen),
        "dead_lettered": len(letters), "dlq_reasons": [d.reason for d in letters],
        "publish_mb_per_s": round(megabytes / published_s, 1),
        "end_to_end_mb_per_s": round(megabytes / total_s, 1),
        "ok": len(seen) == groups and len(letters) == 1,
    }


async def _read_dead_letters(bus, dlq: str, run: str) -> list[DeadLetter]:
    async with bus.consumer([dlq], group_id=f"{run}-dlq-reader") as consumer:
        records = await consumer.poll(timeout_s=10.0)
    return [decode(r.value, DeadLetter) for r in records]
