"""What the scripts that build an environment beside the main install share
(`vllm_cpu_env.py`, `trl_env.py`): the command line, the stamp that makes a rerun a no-op, the
venv, pip.

An environment is rebuilt when its stamp (what the script builds it from, this checkout's
pyproject.toml and the Python version) changes; one that matches only re-links this checkout in
editable mode, so it runs the code beside the script, not another clone's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class SideEnv:
    label: str  # what the log calls it ("vLLM", "TRL")
    tag: str  # the log lines' prefix
    stamp_name: str  # the stamp file in the venv
    stamp: dict  # what the script builds it from
    populate: Callable[[Path, Path], None]  # (python, venv): install everything into it
    check: str  # Python run in it once built (stderr: versions; must not print to stdout)

    def log(self, message: str) -> None:
        print(f"[{self.tag}] {message}", file=sys.stderr, flush=True)

    def wanted(self) -> dict:
        pyproject = hashlib.sha256((REPO / "pyproject.toml").read_bytes()).hexdigest()
        return {**self.stamp, "pyproject": pyproject, "python": sys.version.split()[0]}


def cli(env: SideEnv, default_venv: Path, variable: str, doc: str,
        argv: list[str] | None = None) -> int:
    """`--venv DIR` (default `default_venv`, or the environment variable `variable`); prints
    the built environment's python on stdout, the only thing it prints there."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--venv", type=Path, default=default_venv,
                        help=f"where to build it (default {default_venv}; env {variable})")
    args = parser.parse_args(argv)
    print(build(env, args.venv.expanduser().resolve()))
    return 0


def build(env: SideEnv, venv: Path) -> Path:
    """The python of a ready environment at `venv`, built or rebuilt as needed."""
    python = venv / "bin" / "python"
    wanted = env.wanted()
    stamp = venv / env.stamp_name
    if python.is_file() and stamp.is_file() and json.loads(stamp.read_text()) == wanted:
        env.log(f"{env.label} environment at {venv} is up to date")
        install(python, ["--no-deps", "-e", str(REPO)])  # this checkout, not another one
        return python
    began = time.monotonic()
    if not python.is_file():
        env.log(f"creating {venv}")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    stamp.unlink(missing_ok=True)
    install(python, ["--upgrade", "pip"])
    env.populate(python, venv)
    subprocess.run([str(python), "-c", env.check], check=True)  # stdout carries only the python
    stamp.write_text(json.dumps(wanted))
    env.log(f"built in {time.monotonic() - began:.0f} s")
    return python


def install(python: Path, args: list[str]) -> None:
    subprocess.run([str(python), "-m", "pip", "install", "-q", *args], check=True)
