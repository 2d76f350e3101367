"""Shared fixtures: one real Kafka broker per test session, and a bus per backend.

The broker is started through `miles.broker` (the code users run), in a temporary data
directory on a free port. Set MILES_TEST_BOOTSTRAP=HOST:PORT to use an already running broker
instead (the broker-restart test is then skipped, since it must own the broker).
"""

from __future__ import annotations

import os
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from miles import broker
from miles.bus import open_bus
from miles.protocol.topics import run_topics


@dataclass
class LocalBroker:
    data_dir: Path | None
    port: int
    bootstrap: str

    @property
    def url(self) -> str:
        return f"kafka://{self.bootstrap}"

    @property
    def owned(self) -> bool:
        return self.data_dir is not None

    def stop(self) -> None:
        broker.stop_broker(data_dir=self.data_dir)

    def start(self) -> None:
        broker.start_broker(data_dir=self.data_dir, port=self.port, heap="512m")


@pytest.fixture(scope="session")
def kafka_broker():
    existing = os.environ.get("MILES_TEST_BOOTSTRAP")
    if existing:
        yield LocalBroker(data_dir=None, port=int(existing.rsplit(":", 1)[1]), bootstrap=existing)
        return
    with tempfile.TemporaryDirectory(prefix="miles-test-broker-") as tmp:
        port = broker.free_port()
        info = broker.start_broker(data_dir=Path(tmp), port=port, heap="512m")
        local = LocalBroker(data_dir=Path(tmp), port=port, bootstrap=info.bootstrap)
        try:
            yield local
        finally:
            local.stop()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A tiny Llama (hidden 64, 2 layers) with the character tokenizer, saved like a real
    checkpoint; shared by the whole session, so never write into it."""
    from miles.tasks.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny"), hidden_size=64, layers=2)


def unique_run() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture(params=["embedded", pytest.param("kafka", marks=pytest.mark.kafka)])
def bus_url(request) -> str:
    if request.param == "embedded":
        return "embedded://"
    return request.getfixturevalue("kafka_broker").url


@pytest.fixture
async def bus(bus_url):
    async with open_bus(bus_url) as bus:
        yield bus


@pytest.fixture
async def run(bus) -> str:
    """A fresh run name whose five topics exist on `bus`."""
    name = unique_run()
    await bus.create_topics(run_topics(name, prompt_partitions=3, trajectory_partitions=3))
    return name
