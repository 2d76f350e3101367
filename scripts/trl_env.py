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

import os
import sys
from pathlib import Path

from side_env import REPO, SideEnv, cli, install

TRL = "trl==1.16.0"
CONSTRAINTS = ("torch==2.15.0", "transformers==5.25.0", "peft==0.21.2", "accelerate==1.16.0",
               "datasets==5.2.0")
"""The versions of Miles' main environment when the harness was written (TRL 1.16.0 accepts
them all: transformers>=4.56.2, accelerate>=1.10.1, datasets>=4.7.0, peft>=0.13.0)."""
DEFAULT_VENV = Path(os.environ.get("MILES_TRL_ENV", Path.home() / ".cache" / "miles" / "trl-env"))
STAMP = "miles-trl-stamp.json"


def populate(python: Path, venv: Path) -> None:
    constraints = venv / "constraints.txt"
    constraints.write_text("\n".join([TRL, *CONSTRAINTS]) + "\n")
    ENV.log(f"installing {TRL}, {', '.join(CONSTRAINTS)} and Miles (torch is a large download)")
    install(python, ["-c", str(constraints), TRL, *CONSTRAINTS, "-e", str(REPO)])


ENV = SideEnv(label="TRL", tag="trl-env", stamp_name=STAMP,
              stamp={"trl": TRL, "constraints": list(CONSTRAINTS)}, populate=populate,
              check="import sys, torch, transformers, trl, miles; print('trl', trl.__version__, "
                    "'torch', torch.__version__, 'transformers', transformers.__version__, "
                    "file=sys.stderr)")


if __name__ == "__main__":
    sys.exit(cli(ENV, DEFAULT_VENV, "MILES_TRL_ENV", __doc__))
