"""The secured broker (`miles broker start --secure`): SASL_SSL with SCRAM users and ACLs.

The broker is the session's `secured` fixture (tests/conftest.py, shared with
`test_secured_run.py`); each test gets a fresh run (`secured_run`) whose built-in users have
their roles' ACLs.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from miles.bus.kafka import KafkaBus
from miles.errors import AuthenticationError, AuthorizationError
from miles.protocol.topics import run_topics, topic_name
from tests.conftest import unique_run

pytestmark = pytest.mark.kafka
FAIL_FAST_S = 10.0  # a refused identity or ACL fails well before the start timeout (30 s)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def run(secured_run) -> str:
    return secured_run


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
    async with secured.bus("producer") as producer:
        delivery = await (await producer.send(trajectories, b"group-1", key=b"k"))
    assert delivery.offset == 0
    async with secured.bus("reader", sasl_mechanism="SCRAM-SHA-256") as reader:
        records = await read_one(reader, trajectories, f"miles.{run}.recorder")
    assert [r.value for r in records] == [b"group-1"]


async def test_wrong_password_is_refused_at_once(secured, tmp_path):
    wrong = tmp_path / "password"
    wrong.write_text("not-the-password\n")
    started = time.monotonic()
    with pytest.raises(AuthenticationError) as caught:
        async with secured.bus("trainer", sasl_password_file=wrong):
            pass
    assert time.monotonic() - started < FAIL_FAST_S
    message = str(caught.value)
    assert "refused user 'trainer'" in message and "Check the password" in message
    assert str(wrong) in message and "not-the-password" not in message


async def test_unknown_ca_fails_the_tls_handshake_clearly(secured):
    with pytest.raises(AuthenticationError, match="kafka.ssl_cafile"):
        async with secured.bus("trainer", ssl_cafile=None):  # the system CAs
            pass


async def test_producer_cannot_write_control_but_the_trainer_can(secured, run):
    control = topic_name(run, "control")
    async with secured.bus("producer") as producer:
        with pytest.raises(AuthorizationError, match=f"user 'producer' access to topic {control}"):
            await (await producer.send(control, b"forged"))
    async with secured.bus("trainer") as trainer:
        assert (await (await trainer.send(control, b"version"))).offset == 0


async def test_missing_acls_get_clear_errors(secured, run):
    async with secured.bus("reader") as reader:
        started = time.monotonic()
        with pytest.raises(AuthorizationError, match="access to group elsewhere"):
            await read_one(reader, topic_name(run, "trajectories"), "elsewhere")
        assert time.monotonic() - started < FAIL_FAST_S
        with pytest.raises(AuthorizationError, match="user 'reader' access to topic"):
            await (await reader.send(topic_name(run, "trajectories"), b"x"))
    async with secured.bus("producer") as producer:
        with pytest.raises(AuthorizationError, match="creating topics"):
            await producer.create_topics(run_topics(unique_run()))


async def test_only_the_live_daemons_join_their_groups(secured, run):
    """Whoever joins the trainer's or the producers' prompt group takes its partitions and
    commits its offsets: readers (and producers, for the trainer's) are denied both."""
    trajectories, prompts = topic_name(run, "trajectories"), topic_name(run, "prompts")
    async with secured.bus("reader") as reader:
        for topic, group in ((trajectories, "trainer"), (prompts, "producers")):
            with pytest.raises(AuthorizationError, match=f"access to group miles.{run}.{group}"):
                await read_one(reader, topic, f"miles.{run}.{group}")
    async with secured.bus("producer") as producer:
        with pytest.raises(AuthorizationError, match=f"access to group miles.{run}.trainer"):
            await read_one(producer, prompts, f"miles.{run}.trainer")
    async with secured.bus("trainer") as trainer:
        with pytest.raises(AuthorizationError, match="access to topic"):
            await read_one(trainer, topic_name(run, "control"), f"miles.{run}.trainer")


@contextlib.contextmanager
def nothing_left_unclosed(caplog):
    """Fails when a Kafka client made inside is never closed: aiokafka warns (ResourceWarning)
    and logs "Unclosed ..." through the event loop when it collects one."""
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.ERROR, "asyncio"):
        warnings.simplefilter("always", ResourceWarning)
        yield
        gc.collect()
    left = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    left += [r.getMessage() for r in caplog.records if "Unclosed" in r.getMessage()]
    assert not left, left


async def start_refused(consumer_of) -> str:
    """Start a consumer that the broker refuses; the error's text (no reference kept)."""
    try:
        await consumer_of().start()
    except (AuthenticationError, AuthorizationError) as err:
        return str(err)
    raise AssertionError("the consumer started")


async def test_a_refused_start_leaves_no_client_unclosed(secured, run, tmp_path, caplog):
    wrong = tmp_path / "password"
    wrong.write_text("not-the-password\n")
    trajectories = [topic_name(run, "trajectories")]
    with nothing_left_unclosed(caplog):
        refused = secured.bus("reader", sasl_password_file=wrong)
        message = await start_refused(
            lambda: refused.consumer(trajectories, group_id=f"miles.{run}.recorder"))
        assert "refused user 'reader'" in message
        async with secured.bus("reader") as reader:
            message = await start_refused(lambda: reader.consumer(trajectories,
                                                                  group_id="elsewhere"))
        assert "access to group elsewhere" in message
        with pytest.raises(AuthenticationError):
            async with refused:
                pass


def test_cli_reads_the_credentials_from_the_environment(secured, run):
    env = {**os.environ, "PYTHONPATH": str(REPO), **secured.env("reader")}
    command = [sys.executable, "-m", "miles.cli", "topics", "describe",
               "--bootstrap", secured.url, "--run", run]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert f"{topic_name(run, 'control')}: partitions=1" in result.stdout
    env["MILES_KAFKA_PASSWORD"] = "wrong"
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "refused user 'reader'" in result.stderr
