"""compose/docker-compose.yml must agree with the broker Miles runs itself and with its limits."""

from pathlib import Path

import pytest
import yaml

from miles import broker
from miles.protocol.topics import TOPIC_MAX_MESSAGE_BYTES

COMPOSE = Path(__file__).resolve().parents[2] / "compose" / "docker-compose.yml"
# Keys whose values depend on the host (ports, paths, voters) and are set per deployment.
HOST_SPECIFIC = {"controller.quorum.voters", "listeners", "advertised.listeners", "log.dirs",
                 "node.id", "listener.security.protocol.map", "num.partitions",
                 "num.recovery.threads.per.data.dir", "offsets.topic.num.partitions",
                 "transaction.state.log.num.partitions"}


def env_name(key: str) -> str:
    """The apache/kafka image's rule: . -> _, _ -> __, - -> ___, upper-cased, KAFKA_ prefix."""
    return "KAFKA_" + key.replace("_", "__").replace("-", "___").replace(".", "_").upper()


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load(COMPOSE.read_text())


def test_broker_settings_match_the_local_broker(compose):
    env = {k: str(v) for k, v in compose["services"]["kafka"]["environment"].items()}
    local = broker.server_settings(Path("/tmp/x"), 9092, 9093)
    shared = {k: v for k, v in local.items() if k not in HOST_SPECIFIC}
    assert shared, "nothing to compare"
    for key, value in shared.items():
        assert env.get(env_name(key)) == value, f"{env_name(key)} should be {value}"


def test_size_limits_agree_with_the_protocol(compose):
    env = compose["services"]["kafka"]["environment"]
    assert int(env["KAFKA_MESSAGE_MAX_BYTES"]) == TOPIC_MAX_MESSAGE_BYTES
    assert int(env["KAFKA_REPLICA_FETCH_MAX_BYTES"]) == TOPIC_MAX_MESSAGE_BYTES


def test_listeners_host_and_network(compose):
    kafka = compose["services"]["kafka"]
    advertised = kafka["environment"]["KAFKA_ADVERTISED_LISTENERS"].split(",")
    assert "PLAINTEXT_HOST://localhost:9092" in advertised
    assert "PLAINTEXT://kafka:19092" in advertised
    assert "9092:9092" in kafka["ports"]
    assert kafka["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"


def test_data_lives_on_a_volume_and_health_is_checked(compose):
    kafka = compose["services"]["kafka"]
    data_dir = kafka["environment"]["KAFKA_LOG_DIRS"]
    assert any(v.endswith(f":{data_dir}") for v in kafka["volumes"])
    assert kafka["healthcheck"]["test"]
    assert kafka["image"].startswith("apache/kafka:4.1")


def test_topics_service_creates_the_run_topics_on_the_network_listener(compose):
    topics = compose["services"]["topics"]
    command = topics["command"]
    assert command[:3] == ["miles", "topics", "create"]
    assert command[command.index("--bootstrap") + 1] == "kafka:19092"
    assert topics["depends_on"]["kafka"]["condition"] == "service_healthy"
    for name in ("producer", "trainer"):
        assert compose["services"][name]["depends_on"]["topics"]["condition"] == \
            "service_completed_successfully"


def test_cluster_ids_never_start_with_a_dash(monkeypatch):
    """The storage tool reads a leading "-" as an option: such an id must be drawn again."""
    import uuid

    draws = iter([uuid.UUID(bytes=b"\xf8" + bytes(15)), uuid.UUID(bytes=bytes(16))])
    monkeypatch.setattr(broker.uuid, "uuid4", lambda: next(draws))
    assert broker._cluster_id() == "AAAAAAAAAAAAAAAAAAAAAA"  # the "-" id was skipped
