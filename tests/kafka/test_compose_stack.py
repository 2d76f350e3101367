"""The compose stack's services, run outside Docker as compose/docker-compose.yml gives them.

Each service's command line runs with the environment the file gives it and nothing else from
this machine's (PATH, HOME, and PYTHONPATH for the image's installed package), its named volumes
as folders under a temp root and every container path of its mounts rewritten onto them, in the
image's working directory (/opt/miles, which holds this repository's files: compose/Dockerfile).
`python` and `miles` are this interpreter's, as the image's are its own. Docker sets
HOSTNAME to the container id in each container; here each producer replica gets its own. The
one substitution: the broker's address on the compose network (kafka:19092, in MILES_BUS) is
this session's broker.

Host variables are set as a user would export them (a small run: MILES_SFT_STEPS, groups per
step). Then `topics` and `init` run to completion, and trainer, two producer replicas and the
evaluator run together until the trainer has trained steps on groups of both producers and each
producer has loaded a version. A path the file gets wrong, a mount a service lacks (a container
path left in its environment), a command line a daemon refuses, all fail here.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import compose as spec
from tests.conftest import unique_run

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
IMAGE_WORKDIR = "/opt/miles"  # compose/Dockerfile: WORKDIR, holding the repository's files
NETWORK_BUS = "kafka://kafka:19092"
CONTAINER_ROOTS = ("/var/lib/miles", IMAGE_WORKDIR)
STEPS = 3
BROKER_LABEL = "kafka-1"  # a broker a test starts itself (test_compose_secure.py)
RUN_TIMEOUT_S = 420.0
ONE_SHOT_TIMEOUT_S = 240.0
SHIMS = {"python": [sys.executable], "miles": [sys.executable, "-m", "miles.cli"]}


def host_variables(run: str) -> dict[str, str]:
    """What a user would export for a small, quick run."""
    return {"MILES_RUN": run, "MILES_SFT_STEPS": "3", "MILES_FEED_EPOCHS": "1",
            "MILES_GROUPS_PER_STEP": "4", "MILES_MAX_NEW_TOKENS": "4", "MILES_TORCH_THREADS": "1",
            "MILES_LORA_R": "4", "MILES_LORA_ALPHA": "8", "MILES_EVAL_PROBLEMS": "16"}


def network_addresses(broker_url: str) -> dict[str, str]:
    """The plaintext stack's one network address, kafka:19092, as this session's broker."""
    return {NETWORK_BUS.removeprefix("kafka://"): broker_url.removeprefix("kafka://")}


def shim_dir(root: Path) -> Path:
    """A PATH folder whose python and miles run this interpreter."""
    shims = root / "bin"
    shims.mkdir()
    for name, argv in SHIMS.items():
        path = shims / name
        path.write_text("#!/bin/sh\nexec " + " ".join(argv) + ' "$@"\n')
        path.chmod(0o755)
    return shims


class Stack:
    """The services of one compose project, each runnable as a local process.

    `addresses`: each network address (host:port on the compose network) the services may name,
    and the local one to use instead (the substitution the module docstring describes);
    `image_paths`: folders of a service's image other than the Miles image's own (the Kafka
    image's tools, for its one-shot steps), and what stands in for them here."""

    def __init__(self, root: Path, addresses: dict[str, str], host_env: dict[str, str],
                 files: tuple[Path, ...] = (spec.BASE,),
                 image_paths: dict[str, Path] | None = None):
        self.root = root
        self.addresses = addresses
        self.image_paths = {IMAGE_WORKDIR: REPO, **(image_paths or {})}
        project = spec.load(*files, env=host_env)
        self.services = spec.active_services(project, {"rl", "eval"})
        self.volumes = {name: root / "volumes" / name for name in project.get("volumes", {})}
        for folder in self.volumes.values():
            folder.mkdir(parents=True)
        self.shims = shim_dir(root)
        self.processes: dict[str, subprocess.Popen] = {}

    def mounts(self, name: str) -> dict[str, Path]:
        """Container path -> folder here, for each volume of service `name` and its image."""
        found = dict(self.image_paths)
        for mount in self.services[name].get("volumes", []):
            source, target = spec.mount_source(mount), spec.mount_target(mount)
            if source in self.volumes:
                found[target] = self.volumes[source]
            else:  # a bind mount: relative to the compose file's folder
                found[target] = (spec.COMPOSE_DIR / source).resolve()
        return found

    def parent_folder(self, name: str, path: str, mounts: dict[str, Path]) -> None:
        """`path` holds some of the service's mount points (no volume of its own): a folder
        here with a link per mount point under it."""
        if not path.startswith("/") or path.rstrip("/") == "" or path in mounts:
            return
        children = {t: f for t, f in mounts.items() if t.startswith(path.rstrip("/") + "/")}
        if not children:
            return
        folder = self.root / "parents" / name / path.strip("/").replace("/", "-")
        for target, source in children.items():
            link = folder / target[len(path):].strip("/")
            link.parent.mkdir(parents=True, exist_ok=True)
            if not link.exists():
                link.symlink_to(source, target_is_directory=True)
        mounts[path] = folder

    def rewrite(self, text: str, mounts: dict[str, Path], where: str) -> str:
        for target in sorted(mounts, key=len, reverse=True):
            text = re.sub(re.escape(target) + r"(?=[/\s\"']|$)", str(mounts[target]), text)
        for root in CONTAINER_ROOTS:
            assert root not in text, f"{where}: {text!r} names {root} on no volume of the service"
        for network, local in self.addresses.items():
            text = text.replace(network, local)
        return text

    def command(self, name: str, hostname: str) -> tuple[list[str], dict[str, str]]:
        service, mounts = self.services[name], self.mounts(name)
        raw_env = spec.environment(service)
        for value in raw_env.values():
            self.parent_folder(name, value, mounts)
        if "MILES_BUS" in raw_env:
            assert raw_env["MILES_BUS"].removeprefix("kafka://") in self.addresses, \
                f"{name}: MILES_BUS {raw_env['MILES_BUS']} is not on the compose network"
        env = {key: self.rewrite(value, mounts, f"{name}: {key}")
               for key, value in raw_env.items()}
        argv = [self.rewrite(arg, mounts, f"{name}: command")
                for arg in [*service.get("entrypoint", []), *service.get("command", [])]]
        base = {"PATH": f"{self.shims}:{os.environ['PATH']}", "HOME": os.environ["HOME"],
                "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "HOSTNAME": hostname}
        return argv, {**base, **env}

    def start(self, name: str, replica: int = 1) -> subprocess.Popen:
        label = f"{name}-{replica}"
        argv, env = self.command(name, hostname=f"c0ffee{replica:06d}")
        log = open(self.root / f"{label}.log", "w")
        process = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        self.processes[label] = process
        return process

    def log(self, label: str) -> str:
        return (self.root / f"{label}.log").read_text()

    def run_once(self, name: str) -> None:
        process = self.start(name)
        try:
            rc = process.wait(timeout=ONE_SHOT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.stop_all()
            raise AssertionError(f"{name} did not finish:\n{self.log(name + '-1')[-3000:]}")
        assert rc == 0, f"{name} exited {rc}:\n{self.log(name + '-1')[-3000:]}"

    def stop_all(self) -> dict[str, int]:
        """SIGTERM to each main process, as `docker compose stop` sends it to PID 1, then wait;
        what is left of a process group after the wait is killed. A broker run here stops last,
        as compose stops services before those they depend on."""
        codes = {}
        daemons = [label for label in self.processes if label != BROKER_LABEL]
        for labels in (daemons, [label for label in self.processes if label == BROKER_LABEL]):
            for label in labels:
                if self.processes[label].poll() is None:
                    self.processes[label].send_signal(signal.SIGTERM)
            for label in labels:
                process = self.processes[label]
                try:
                    codes[label] = process.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    codes[label] = process.wait()
        return codes


def ledger_producers(path: Path) -> tuple[int, set[str]]:
    """(steps trained, producer ids of the trained groups) from the trainer's ledger; a group id
    is TASK/eEPOCH/PRODUCER/SEQUENCE."""
    if not path.exists():
        return 0, set()
    lines = [json.loads(line) for line in path.read_text().splitlines() if line]
    producers = {group.split("/")[-2] for line in lines for group in line["trained"]}
    return len(lines), producers


def wait_for(condition, stack: Stack, what: str, timeout_s: float = RUN_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        dead = {label: p.returncode for label, p in stack.processes.items()
                if p.poll() is not None and p.returncode != 0}
        if dead:
            label = next(iter(dead))
            raise AssertionError(f"{label} exited {dead[label]} while waiting for {what}:\n"
                                 f"{stack.log(label)[-3000:]}")
        time.sleep(1.0)
    logs = "\n".join(f"--- {label}\n{stack.log(label)[-1500:]}" for label in stack.processes)
    raise AssertionError(f"timed out waiting for {what}\n{logs}")


def test_the_rl_profile_runs_the_whole_loop_outside_docker(kafka_broker, tmp_path):
    run = unique_run()
    stack = Stack(tmp_path, network_addresses(kafka_broker.url), host_variables(run))
    runs = stack.volumes["miles-runs"] / run
    try:
        stack.run_once("topics")
        stack.run_once("init")
        assert (stack.volumes["miles-model"] / "config.json").exists()
        assert (stack.volumes["miles-public"] / "control.pub").exists()
        assert not (stack.volumes["miles-public"] / "control.key").exists()
        assert (runs / ".fed").exists()
        stack.start("trainer")
        stack.start("producer", 1)
        stack.start("producer", 2)  # --scale producer=2
        stack.start("evaluator")

        def trained() -> bool:
            steps, producers = ledger_producers(runs / "ledger.jsonl")
            loaded = all("loaded policy version" in stack.log(f"producer-{i}") for i in (1, 2))
            return steps >= STEPS and len(producers) == 2 and loaded
        wait_for(trained, stack, f"{STEPS} steps on groups of both producers, versions loaded")
        evaluation = stack.volumes["miles-evaluation"] / f"{run}.jsonl"
        wait_for(lambda: evaluation.exists() and '"held_out"' in evaluation.read_text(), stack,
                 "a held-out measurement by the evaluator")
    finally:
        codes = stack.stop_all()
    steps, producers = ledger_producers(runs / "ledger.jsonl")
    assert producers == {"producer-c0ffee000001", "producer-c0ffee000002"}
    assert sorted(p.name for p in (runs / "weights").iterdir() if p.is_dir())[-1] >= "v00000001"
    for label in ("producer-1", "producer-2", "evaluator-1"):
        assert codes[label] == 0, f"{label} exited {codes[label]}:\n{stack.log(label)[-3000:]}"
    assert codes["trainer-1"] == 0, stack.log("trainer-1")[-3000:]


def test_a_service_without_the_volume_its_path_is_on_fails(kafka_broker, tmp_path):
    """The check above can fail: a producer that lost its miles-runs mount is refused."""
    stack = Stack(tmp_path, network_addresses(kafka_broker.url), host_variables(unique_run()))
    producer = stack.services["producer"]
    producer["volumes"] = [m for m in producer["volumes"] if "miles-runs" not in m]
    with pytest.raises(AssertionError, match="on no volume"):
        stack.command("producer", hostname="x")
