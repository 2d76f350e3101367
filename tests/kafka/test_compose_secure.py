"""compose/secure.yml's steps, run outside Docker as the file gives them, against a real broker
started from the server.properties its `kafka-secrets` step writes.

As in test_compose_stack.py, each service's command line runs with its environment and its
volumes as temp folders. The Kafka image's one-shot steps run their scripts here (keytool and
`kafka-configs.sh`, which runs Kafka's ConfigCommand from the jars the test session uses).
Substituted, because the compose network does not exist here: its addresses (kafka:19093,
kafka:19094, kafka:29093) become 127.0.0.1 with free ports, in the services' settings and in
the files the secrets step writes (server.properties, security.json), and the broker's log
folder. The broker is started as the image starts it: `kafka-storage format` with the compose
file's CLUSTER_ID, then `kafka.Kafka` on that server.properties.

Then `kafka-users` creates the SCRAM users, `topics` (as admin) creates the run's topics and
grants each role's ACLs, `init` feeds as `feeder`, and trainer and producer train and load
versions as `trainer` and `producer`: wrong TLS files, listener settings, users or ACLs fail here.
"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from miles import broker
from tests import compose as spec
from tests.conftest import unique_run
from tests.kafka.test_compose_stack import (BROKER_LABEL, Stack, host_variables, ledger_producers,
                                            wait_for)

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
NETWORK = ("kafka:19093", "kafka:19094", "kafka:29093")
HOST_LISTENER = 9093
STEPS = 2


def kafka_tools(root: Path, libs: Path) -> Path:
    """What stands in for the Kafka image's /opt/kafka/bin: kafka-configs.sh."""
    tools = root / "kafka-bin"
    tools.mkdir()
    script = tools / "kafka-configs.sh"
    argv = broker.java_command(libs, "kafka.admin.ConfigCommand", heap="256m")
    script.write_text("#!/bin/sh\nexec " + " ".join(map(shlex.quote, argv)) + ' "$@"\n')
    script.chmod(0o755)
    return tools


def localised(text: str, addresses: dict[str, str], host_port: int) -> str:
    for network, local in addresses.items():
        text = text.replace(network, local)
    return text.replace(f"localhost:{HOST_LISTENER}", f"localhost:{host_port}") \
        .replace(f"://:{HOST_LISTENER},", f"://127.0.0.1:{host_port},")


def start_broker(stack: Stack, config: Path, cluster_id: str, host_port: int):
    """Format and start Kafka on the (localised) server.properties of the secrets step."""
    libs = broker.ensure_kafka_libs()
    data = stack.root / "broker"
    data.mkdir()
    properties = config.read_text().replace("log.dirs=/var/lib/kafka/data",
                                            f"log.dirs={data / 'logs'}")
    properties = localised(properties, stack.addresses, host_port)
    for network, local in stack.addresses.items():  # listeners bind to the local addresses
        port = network.split(":")[1]
        properties = properties.replace(f"://:{port}", f"://{local}")
    (data / "server.properties").write_text(properties)
    (data / "log4j2.properties").write_text(broker.LOG4J2_PROPERTIES)
    log4j = data / "log4j2.properties"
    subprocess.run(broker.java_command(libs, "kafka.tools.StorageTool", "format", "-t",
                                       cluster_id, "-c", str(data / "server.properties"),
                                       log_config=log4j),
                   check=True, capture_output=True, timeout=120)
    log = open(stack.root / f"{BROKER_LABEL}.log", "w")
    process = subprocess.Popen(broker.java_command(libs, "kafka.Kafka",
                                                   str(data / "server.properties"),
                                                   log_config=log4j),
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    stack.processes[BROKER_LABEL] = process
    internal = int(stack.addresses["kafka:19094"].split(":")[1])
    wait_for(lambda: broker.port_is_open(internal), stack, "the secured broker", 120)


def test_the_secure_variant_runs_the_loop_as_each_role(tmp_path):
    run = unique_run()
    addresses = {name: f"127.0.0.1:{broker.free_port()}" for name in NETWORK}
    host_port = broker.free_port()
    libs = broker.ensure_kafka_libs()
    stack = Stack(tmp_path, addresses, host_variables(run),
                  files=(spec.BASE, spec.OVERRIDES["secure"]),
                  image_paths={"/opt/kafka/bin": kafka_tools(tmp_path, libs)})
    admin = stack.volumes["miles-kafka-admin"]
    try:
        stack.run_once("kafka-secrets")
        # security.json names the CA where `topics` mounts the admin's folder (MILES_ROLE_DIR);
        # here that is the admin's volume, not the secrets step's folder of links.
        _, secrets_env = stack.command("kafka-secrets", hostname="x")
        security = admin / "security.json"
        security.write_text(localised(security.read_text(), addresses, host_port)
                            .replace(secrets_env["MILES_ROLE_DIR"], str(admin)))
        config = stack.volumes["kafka-config"] / "server.properties"
        start_broker(stack, config, spec.environment(stack.services["kafka"])["CLUSTER_ID"],
                     host_port)
        stack.run_once("kafka-users")
        stack.run_once("topics")
        assert "ACLs granted" in stack.log("topics-1")
        stack.run_once("init")  # feeds as `feeder`
        stack.start("trainer")
        stack.start("producer", 1)

        def trained() -> bool:
            steps, producers = ledger_producers(stack.volumes["miles-runs"] / run /
                                                "ledger.jsonl")
            return steps >= STEPS and "loaded policy version" in stack.log("producer-1")
        wait_for(trained, stack, f"{STEPS} steps and a loaded version on the secured broker")
    finally:
        codes = stack.stop_all()
    for label in ("trainer-1", "producer-1"):
        assert codes[label] == 0, stack.log(label)[-3000:]
    for role in ("trainer", "producer", "feeder", "reader"):
        folder = stack.volumes[f"miles-kafka-{role}"]
        assert sorted(p.name for p in folder.iterdir()) == ["ca.pem", "password"], role


def test_secrets_are_made_once(tmp_path):
    """A second `up` keeps the CA and passwords (the broker's log and clients depend on them)."""
    stack = Stack(tmp_path, {}, host_variables(unique_run()),
                  files=(spec.BASE, spec.OVERRIDES["secure"]))
    stack.run_once("kafka-secrets")
    password = (stack.volumes["miles-kafka-trainer"] / "password").read_text()
    stack.processes.clear()
    stack.run_once("kafka-secrets")
    assert "made before" in stack.log("kafka-secrets-1")
    assert (stack.volumes["miles-kafka-trainer"] / "password").read_text() == password
