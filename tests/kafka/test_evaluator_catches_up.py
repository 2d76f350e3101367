"""The evaluator's `read_topics` on the real broker takes in every version announced before the
call, however many the client had not fetched yet. It once stopped at the first poll that came
back empty after the first: the client holds one fetch per partition, fetched long before, so
against a trainer announcing several versions a second it fell further behind at every call,
until each version it saw had been pruned from the weight store and it never measured one (the
compose stack's evaluator: no held-out point in 5 minutes)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from miles.bus import open_bus
from miles.engines.base import LoraSettings
from miles.evaluation import Evaluator
from miles.protocol import encode
from miles.protocol.topics import run_topics, topic_name
from miles.weights.following import FollowConfig
from tests.conftest import unique_run
from tests.integration.test_weight_loading import versions  # noqa: F401 (fixture)

pytestmark = [pytest.mark.kafka]
LORA = LoraSettings(r=4, alpha=8)
BURST = 50  # versions announced while the client holds an earlier fetch


async def test_read_topics_takes_in_every_version_announced_before_it(kafka_broker, model_dir,
                                                                      versions):
    store, records = versions
    run = unique_run()
    async with open_bus(kafka_broker.url) as bus:
        await bus.create_topics(run_topics(run, prompt_partitions=1, trajectory_partitions=1))
        control = topic_name(run, "control")

        async def announce(version: int) -> None:
            await bus.publish(control, encode(replace(records[1], policy_version=version)))

        async with Evaluator(bus, run, model_dir, LORA, [], every_s=60,
                             weights=FollowConfig(store=store)) as evaluator:
            await announce(1)
            for _ in range(100):  # joined and caught up
                await evaluator.read_topics(wait_s=0.2)
                if evaluator.announced == 1:
                    break
            assert evaluator.announced == 1
            await announce(2)
            await asyncio.sleep(1.0)  # the client fetches version 2 and holds it
            for version in range(3, 3 + BURST):
                await announce(version)
            await evaluator.read_topics(wait_s=0.2)
            assert evaluator.announced == 2 + BURST
