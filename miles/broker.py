"""A local single-node Apache Kafka broker (KRaft), assembled from Maven Central jars.

No Docker and no Apache download mirror: `compose/kafka/pom.xml` names the broker, its logging
backend and Kafka's perf tools; Maven copies them (once per Kafka version) into a cache folder
outside git, and the broker runs as `java -cp "<libs>/*" kafka.Kafka server.properties`.

One data directory holds one broker: `server.properties`, the KRaft log (`kafka-logs/`), the
console log (`broker.log`) and `broker.json` (pid, ports, bootstrap address). The log is formatted
the first time and reused on every later start, so topics and records survive restarts. `start`
returns only when the broker answers a real Kafka request (a metadata call through the admin
client), not merely when the port opens. `stop` sends SIGTERM, which makes Kafka run its
controlled shutdown.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from miles import broker_security

from miles.errors import BrokerError
from miles.protocol.topics import TOPIC_MAX_MESSAGE_BYTES

KAFKA_VERSION = os.environ.get("MILES_KAFKA_VERSION", "4.1.1")
REPO_ROOT = Path(__file__).resolve().parent.parent
POM_PATH = REPO_ROOT / "compose" / "kafka" / "pom.xml"
DEFAULT_PORT = 9092
DEFAULT_HEAP = "1g"
START_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 60.0
MAVEN_TIMEOUT_S = 900.0

LOG4J2_PROPERTIES = """\
status = warn
appender.console.type = Console
appender.console.name = STDOUT
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = info
rootLogger.appenderRef.stdout.ref = STDOUT
logger.ak.name = org.apache.kafka
logger.ak.level = warn
logger.state.name = state.change.logger
logger.state.level = warn
"""


@dataclass(frozen=True, kw_only=True)
class BrokerInfo:
    """What `broker.json` records about a running broker."""

    pid: int
    port: int
    controller_port: int
    bootstrap: str
    kafka_version: str
    data_dir: str
    secure: bool = False  # SASL_SSL with SCRAM users and ACLs (`miles.broker_security`)


def default_data_dir() -> Path:
    return Path(os.environ.get("MILES_BROKER_DIR", Path.home() / ".local/share/miles/broker"))


def resolve_dir(data_dir: Path | None) -> Path:
    """The absolute data directory: `data_dir`, else the default one."""
    return Path(data_dir or default_data_dir()).resolve()


def default_libs_dir() -> Path:
    if "MILES_KAFKA_LIBS" in os.environ:
        return Path(os.environ["MILES_KAFKA_LIBS"])
    return Path.home() / ".cache" / "miles" / f"kafka-{KAFKA_VERSION}" / "libs"


def ensure_kafka_libs(libs_dir: Path | None = None) -> Path:
    """Collect the broker's jars with Maven unless a previous run already did."""
    libs_dir = libs_dir or default_libs_dir()
    done_marker = libs_dir / ".complete"
    if done_marker.exists():
        return libs_dir
    if shutil.which("mvn") is None:
        raise BrokerError("Maven (`mvn`) is needed once to collect the Kafka jars; install it "
                          "(e.g. `apt-get install maven`) or set MILES_KAFKA_LIBS to a jar folder")
    if shutil.which("java") is None:
        raise BrokerError("Java 17+ (`java`) is needed to run the Kafka broker")
    if libs_dir.exists():
        shutil.rmtree(libs_dir)
    libs_dir.mkdir(parents=True)
    cmd = ["mvn", "-q", "-B", "-f", str(POM_PATH), "package",
           f"-Dkafka.version={KAFKA_VERSION}", f"-Dkafka.libs.dir={libs_dir}",
           f"-Dmiles.build.dir={libs_dir.parent / 'build'}"]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=MAVEN_TIMEOUT_S)
    except subprocess.CalledProcessError as err:
        raise BrokerError(f"collecting Kafka jars failed: {' '.join(cmd)}\n{err.stdout}\n"
                          f"{err.stderr}") from err
    except subprocess.TimeoutExpired as err:
        raise BrokerError(f"collecting Kafka jars took over {MAVEN_TIMEOUT_S:.0f} s") from err
    if not any(libs_dir.glob("kafka_2.13-*.jar")):
        raise BrokerError(f"Maven finished but {libs_dir} holds no kafka_2.13 jar")
    done_marker.write_text(KAFKA_VERSION + "\n")
    return libs_dir


def java_command(libs_dir: Path, main_class: str, *args: str, heap: str = "512m",
                 log_config: Path | None = None) -> list[str]:
    """A `java` command line running one of Kafka's main classes from the jar folder."""
    cmd = ["java", f"-Xmx{heap}", "-XX:+UseG1GC", "-Djava.awt.headless=true"]
    if log_config is not None:
        cmd.append(f"-Dlog4j2.configurationFile={log_config}")
    return [*cmd, "-cp", f"{libs_dir}/*", main_class, *args]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_is_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def server_settings(data_dir: Path, port: int, controller_port: int) -> dict[str, str]:
    """The broker's `server.properties` (compose/docker-compose.yml mirrors the shared keys)."""
    return {
        "process.roles": "broker,controller",
        "node.id": "1",
        "controller.quorum.voters": f"1@127.0.0.1:{controller_port}",
        "listeners": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port}",
        "inter.broker.listener.name": "PLAINTEXT",
        "controller.listener.names": "CONTROLLER",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "log.dirs": str(data_dir / "kafka-logs"),
        "num.partitions": "1",
        "num.recovery.threads.per.data.dir": "1",
        "offsets.topic.replication.factor": "1",
        "offsets.topic.num.partitions": "1",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "transaction.state.log.num.partitions": "1",
        "share.coordinator.state.topic.replication.factor": "1",
        "share.coordinator.state.topic.min.isr": "1",
        "group.initial.rebalance.delay.ms": "0",
        "auto.create.topics.enable": "false",
        "message.max.bytes": str(TOPIC_MAX_MESSAGE_BYTES),
        "replica.fetch.max.bytes": str(TOPIC_MAX_MESSAGE_BYTES),
    }


def _cluster_id() -> str:
    """A random KRaft cluster id (URL-safe base64 of 16 bytes). Never one starting with "-",
    which the storage tool would read as an option (Kafka's own Uuid.randomUuid avoids it too);
    1 id in 64 did, and formatting then failed."""
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id


def _format_storage(libs_dir: Path, data_dir: Path, extra: Sequence[str] = ()) -> None:
    if (data_dir / "kafka-logs" / "meta.properties").exists():
        return
    cmd = java_command(libs_dir, "kafka.tools.StorageTool", "format", "-t", _cluster_id(),
                       "-c", str(data_dir / "server.properties"), *extra,
                       log_config=data_dir / "log4j2.properties")
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise BrokerError(f"formatting {data_dir} failed:\n{result.stdout}\n{result.stderr}")


def read_info(data_dir: Path) -> BrokerInfo | None:
    try:
        return BrokerInfo(**json.loads((data_dir / "broker.json").read_text()))
    except (FileNotFoundError, json.JSONDecodeError, TypeError):
        return None


def _is_our_broker(pid: int, data_dir: Path) -> bool:
    """True when `pid` is alive and is the Kafka broker of this data directory."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
    return "kafka.Kafka" in cmdline and str(data_dir / "server.properties") in cmdline


def running_info(data_dir: Path | None = None) -> BrokerInfo | None:
    """The broker of `data_dir` if its process is alive, else None."""
    data_dir = resolve_dir(data_dir)
    info = read_info(data_dir)
    if info is None or not _is_our_broker(info.pid, data_dir):
        return None
    return info


def start_broker(*, data_dir: Path | None = None, port: int = DEFAULT_PORT,
                 heap: str = DEFAULT_HEAP, timeout_s: float = START_TIMEOUT_S,
                 secure: bool = False) -> BrokerInfo:
    """Start (formatting on first use) a broker in the background; return once it serves.
    `secure`: SASL_SSL, SCRAM users and ACLs (`miles.broker_security`; `security.json`)."""
    data_dir = resolve_dir(data_dir)
    existing = running_info(data_dir)
    if existing is not None:
        if existing.secure != secure:
            raise BrokerError(f"the broker of {data_dir} runs with secure={existing.secure}; "
                              "stop it first or use another --data-dir")
        return existing
    if port_is_open(port):
        raise BrokerError(f"port {port} is already in use; pick another with --port")
    libs_dir = ensure_kafka_libs()
    data_dir.mkdir(parents=True, exist_ok=True)
    controller_port = free_port()
    settings = server_settings(data_dir, port, controller_port)
    format_args: list[str] = []
    if secure:
        setup = broker_security.prepare(data_dir, port, free_port())
        settings.update(broker_security.secure_settings(setup, data_dir, port, controller_port))
        format_args = broker_security.scram_format_args(setup)
    properties = data_dir / "server.properties"
    properties.write_text("".join(f"{k}={v}\n" for k, v in settings.items()))
    properties.chmod(0o600)  # the secured broker's holds the admin password
    (data_dir / "log4j2.properties").write_text(LOG4J2_PROPERTIES)
    _format_storage(libs_dir, data_dir, format_args)
    cmd = java_command(libs_dir, "kafka.Kafka", str(data_dir / "server.properties"), heap=heap,
                       log_config=data_dir / "log4j2.properties")
    cmd.insert(1, f"-Dkafka.logs.dir={data_dir / 'logs'}")
    with open(data_dir / "broker.log", "ab") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    info = BrokerInfo(pid=process.pid, port=port, controller_port=controller_port,
                      bootstrap=f"127.0.0.1:{port}", kafka_version=KAFKA_VERSION,
                      data_dir=str(data_dir), secure=secure)
    (data_dir / "broker.json").write_text(json.dumps(asdict(info), indent=2))
    _wait_until_serving(process, info, data_dir, timeout_s)
    return info


def _wait_until_serving(process: subprocess.Popen, info: BrokerInfo, data_dir: Path,
                        timeout_s: float) -> None:
    from miles.bus.kafka import probe_cluster  # the only module that speaks Kafka

    security = broker_security.client_security(data_dir) if info.secure else None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise BrokerError(f"broker exited with code {process.returncode}; "
                              f"see {data_dir / 'broker.log'}:\n{_log_tail(data_dir)}")
        if port_is_open(info.port) and probe_cluster(info.bootstrap, timeout_s=5.0,
                                                     security=security):
            return
        time.sleep(0.25)
    process.terminate()
    raise BrokerError(f"broker did not answer on {info.bootstrap} within {timeout_s:.0f} s; "
                      f"see {data_dir / 'broker.log'}:\n{_log_tail(data_dir)}")


def _log_tail(data_dir: Path, lines: int = 30) -> str:
    try:
        return "\n".join((data_dir / "broker.log").read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no broker.log)"


def stop_broker(*, data_dir: Path | None = None, timeout_s: float = STOP_TIMEOUT_S) -> bool:
    """SIGTERM the broker (controlled shutdown) and wait; False if none was running."""
    data_dir = resolve_dir(data_dir)
    info = running_info(data_dir)
    if info is None:
        return False
    os.kill(info.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _reap(info.pid)
        if not _is_our_broker(info.pid, data_dir):  # a zombie's cmdline is empty too
            return True
        time.sleep(0.1)
    os.kill(info.pid, signal.SIGKILL)
    _reap(info.pid)
    raise BrokerError(f"broker (pid {info.pid}) ignored SIGTERM for {timeout_s:.0f} s and was "
                      "killed; its log may need recovery on the next start")


def _reap(pid: int) -> None:
    """Collect the exit status when the broker is our own child (started in this process)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
