"""Shared fixtures: one real Kafka broker per test session, and a bus per backend.

The broker is started through `miles.broker` (the code users run), in a temporary data
directory on a free port. Set MILES_TEST_BOOTSTRAP=HOST:PORT to use an already running broker
instead (the broker-restart test is then skipped, since it must own the broker).

The secured broker (`miles broker start --secure`: SASL_SSL, SCRAM users, ACLs) is another one
per session, started only when a test asks for `secured` (keytool and the format run once);
`secured_run` gives a test a fresh run whose built-in users have their roles' ACLs.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from miles import broker
from miles.bus import open_bus
from miles.protocol.topics import run_topics

SECURED_HEAP = "512m"


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


@dataclass(frozen=True)
class SecuredBroker:
    data_dir: Path
    url: str

    def security(self, user: str, **changes):
        """`user`'s client settings (its password in a file), with `changes` applied."""
        from miles import broker_security

        security = broker_security.client_security(self.data_dir, user)
        return dataclasses.replace(security, **changes)

    def bus(self, user: str, **changes):
        from miles.bus.kafka import KafkaBus

        return KafkaBus(self.url, security=self.security(user, **changes))

    def env(self, user: str) -> dict[str, str]:
        """The variables a process of `user`'s role reads its credentials from (the password
        in `MILES_KAFKA_PASSWORD`, as a deployment would pass a secret)."""
        security = self.security(user)
        return {"MILES_KAFKA__SECURITY_PROTOCOL": "SASL_SSL",
                "MILES_KAFKA__SASL_USERNAME": user,
                "MILES_KAFKA__SSL_CAFILE": str(security.ssl_cafile),
                "MILES_KAFKA_PASSWORD": security.password()}


@pytest.fixture(scope="session")
def secured():
    with tempfile.TemporaryDirectory(prefix="miles-test-secured-") as tmp:
        info = broker.start_broker(data_dir=Path(tmp), port=broker.free_port(),
                                   heap=SECURED_HEAP, secure=True)
        try:
            yield SecuredBroker(Path(info.data_dir), f"kafka://{info.bootstrap}")
        finally:
            broker.stop_broker(data_dir=Path(tmp))


@pytest.fixture
async def secured_run(secured) -> str:
    """A fresh run on the secured broker: each built-in user has its role's ACLs for it, and
    its topics exist (created by the trainer role, which may)."""
    import asyncio

    from miles import broker_security

    name = unique_run()
    await asyncio.to_thread(broker_security.grant_builtin_roles, secured.data_dir, name)
    async with secured.bus("trainer") as bus:
        await bus.create_topics(run_topics(name, prompt_partitions=1, trajectory_partitions=1))
    return name
