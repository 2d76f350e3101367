"""The secured broker (`miles broker start --secure`): SASL_SSL with SCRAM users and ACLs.

One secured broker per session, started only when a test here asks for it (keytool and the
format run once). Each test gets a fresh run whose built-in users have their roles' ACLs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from miles import broker, broker_security
from miles.bus.kafka import KafkaBus
from miles.errors import AuthenticationError, AuthorizationError
from miles.protocol.topics import run_topics, topic_name
from tests.conftest import unique_run

pytestmark = pytest.mark.kafka
FAIL_FAST_S = 10.0  # a refused identity or ACL fails well before the start timeout (30 s)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def secured():
    with tempfile.TemporaryDirectory(prefix="miles-test-secured-") as tmp:
        info = broker.start_broker(data_dir=Path(tmp), port=broker.free_port(), heap="512m",
                                   secure=True)
        try:
            yield Path(info.data_dir), f"kafka://{info.bootstrap}"
        finally:
            broker.stop_broker(data_dir=Path(tmp))


def client(secured, user: str, **changes) -> KafkaBus:
    data_dir, url = secured
    security = broker_security.client_security(data_dir, user)
    return KafkaBus(url, security=dataclasses.replace(security, **changes))


@pytest.fixture
def run(secured) -> str:
    """A fresh run: its topics exist and each built-in user has its role's ACLs for it."""
    name = unique_run()
    broker_security.grant_builtin_roles(secured[0], name)

    async def create():
        async with client(secured, "trainer") as bus:  # the trainer role may create them
            await bus.create_topics(run_topics(name, prompt_partitions=1,
                                               trajectory_partitions=1))

    asyncio.run(create())
    return name


async def read_one(bus: KafkaBus, topic: str, group: str) -> list:
    async with bus.consumer([topic], group_id=group) as consumer:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            records = await consumer.poll(timeout_s=1.0)
            if records:
                return records
    return []


async def test_right_credentials_publish_consume_and_create(secured, run):
    trajectories = topic_name(run, "trajectories")
    async with client(secured, "producer") as producer:
        delivery = await (await producer.send(trajectories, b"group-1", key=b"k"))
    assert delivery.offset == 0
    async with client(secured, "reader", sasl_mechanism="SCRAM-SHA-256") as reader:
        records = await read_one(reader, trajectories, f"miles.{run}.recorder")
    assert [r.value for r in records] == [b"group-1"]


async def test_wrong_password_is_refused_at_once(secured, tmp_path):
    wrong = tmp_path / "password"
    wrong.write_text("not-the-password\n")
    started = time.monotonic()
    with pytest.raises(AuthenticationError) as caught:
        async with client(secured, "trainer", sasl_password_file=wrong):
            pass
    assert time.monotonic() - started < FAIL_FAST_S
    message = str(caught.value)
    assert "refused user 'trainer'" in message and "Check the password" in message
    assert str(wrong) in message and "not-the-password" not in message


async def test_unknown_ca_fails_the_tls_handshake_clearly(secured):
    with pytest.raises(AuthenticationError, match="kafka.ssl_cafile"):
        async with client(secured, "trainer", ssl_cafile=None):  # the system CAs
            pass


async def test_producer_cannot_write_control_but_the_trainer_can(secured, run):
    control = topic_name(run, "control")
    async with client(secured, "producer") as producer:
        with pytest.raises(AuthorizationError, match=f"user 'producer' access to topic {control}"):
            await (await producer.send(control, b"forged"))
    async with client(secured, "trainer") as trainer:
        assert (await (await trainer.send(control, b"version"))).offset == 0


async def test_missing_acls_get_clear_errors(secured, run):
    async with client(secured, "reader") as reader:
        started = time.monotonic()
        with pytest.raises(AuthorizationError, match="access to group elsewhere"):
            await read_one(reader, topic_name(run, "trajectories"), "elsewhere")
        assert time.monotonic() - started < FAIL_FAST_S
        with pytest.raises(AuthorizationError, match="user 'reader' access to topic"):
            await (await reader.send(topic_name(run, "trajectories"), b"x"))
    async with client(secured, "producer") as producer:
        with pytest.raises(AuthorizationError, match="creating topics"):
            await producer.create_topics(run_topics(unique_run()))


def test_cli_reads_the_credentials_from_the_environment(secured, run):
    data_dir, url = secured
    security = broker_security.client_security(data_dir, "reader")
    env = {**os.environ, "PYTHONPATH": str(REPO),
           "MILES_KAFKA__SECURITY_PROTOCOL": "SASL_SSL", "MILES_KAFKA__SASL_USERNAME": "reader",
           "MILES_KAFKA__SSL_CAFILE": str(security.ssl_cafile),
           "MILES_KAFKA_PASSWORD": security.password()}
    command = [sys.executable, "-m", "miles.cli", "topics", "describe",
               "--bootstrap", url, "--run", run]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert f"{topic_name(run, 'control')}: partitions=1" in result.stdout
    env["MILES_KAFKA_PASSWORD"] = "wrong"
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "refused user 'reader'" in result.stderr
