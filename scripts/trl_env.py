#!/usr/bin/env python3
"""Build a virtual environment with TRL (from PyPI) and Miles in it, for `benchmarks/vs_trl.py`.

    python3 scripts/trl_env.py [--venv DIR]       # prints the environment's python

Why a separate environment: TRL's `GRPOTrainer` wants its own torch, transformers, accelerate
and datasets, and the main Python is shared (other checkouts, CI), so nothing is installed
there. Why these pins: the benchmark compares Miles and TRL, so both must run the same torch
and transformers (a kernel or generation change would otherwise show up as a "framework"
difference). The environment therefore pins the versions the main install runs, PyPI's torch
included (the Linux wheel brings its CUDA libraries: several GB, unused on CPUs), and holds
Miles itself in editable mode with its dependencies resolved under the same constraints, so the
driver runs *every* side (Miles embedded, Miles on Kafka, TRL) with this one interpreter.

Rerunning is cheap: a stamp file records what was built, and an environment that matches it
is left as it is (only this checkout is re-linked in editable mode).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

TRL = "trl==1.16.0"
CONSTRAINTS = ("torch==2.15.0", "transformers==5.25.0", "peft==0.21.2", "accelerate==1.16.0",
               "datasets==5.2.0")
"""The versions of Miles' main environment when the harness was written (TRL 1.16.0 accepts
them all: transformers>=4.56.2, accelerate>=1.10.1, datasets>=4.7.0, peft>=0.13.0)."""
REPO = Path(__file__).resolve().parents[1]
DEFAULT_VENV = Path(os.environ.get("MILES_TRL_ENV", Path.home() / ".cache" / "miles" / "trl-env"))
STAMP = "miles-trl-stamp.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV,
                        help=f"where to build it (default {DEFAULT_VENV}; env MILES_TRL_ENV)")
    args = parser.parse_args(argv)
    python = build(args.venv.expanduser().resolve())
    print(python)
    return 0


def build(venv: Path) -> Path:
    """The python of a ready environment at `venv`, built or rebuilt as needed."""
    python = venv / "bin" / "python"
    wanted = _stamp()
    stamp = venv / STAMP
    if python.is_file() and stamp.is_file() and json.loads(stamp.read_text()) == wanted:
        _log(f"TRL environment at {venv} is up to date")
        _install(python, ["--no-deps", "-e", str(REPO)])  # this checkout, not another one
        return python
    began = time.monotonic()
    if not python.is_file():
        _log(f"creating {venv}")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    stamp.unlink(missing_ok=True)
    _install(python, ["--upgrade", "pip"])
    constraints = venv / "constraints.txt"
    constraints.write_text("\n".join([TRL, *CONSTRAINTS]) + "\n")
    _log(f"installing {TRL}, {', '.join(CONSTRAINTS)} and Miles (torch is a large download)")
    _install(python, ["-c", str(constraints), TRL, *CONSTRAINTS, "-e", str(REPO)])
    check = ("import sys, torch, transformers, trl, miles; "
             "print('trl', trl.__version__, 'torch', torch.__version__, 'transformers', "
             "transformers.__version__, file=sys.stderr)")
    subprocess.run([str(python), "-c", check], check=True)  # stdout carries only the python
    stamp.write_text(json.dumps(wanted))
    _log(f"built in {time.monotonic() - began:.0f} s")
    return python


def _install(python: Path, args: list[str]) -> None:
    subprocess.run([str(python), "-m", "pip", "install", "-q", *args], check=True)


def _stamp() -> dict[str, object]:
    """What the environment is built from; a change rebuilds it."""
    pyproject = hashlib.sha256((REPO / "pyproject.toml").read_bytes()).hexdigest()
    return {"trl": TRL, "constraints": list(CONSTRAINTS), "pyproject": pyproject,
            "python": sys.version.split()[0]}


def _log(message: str) -> None:
    print(f"[trl-env] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
