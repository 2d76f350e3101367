"""Rollout engines: one contract (`RolloutEngine`, `Completion`), a Hugging Face implementation
(`HFEngine`), vLLM in this process (`VLLMEngine`) and a client of a running vLLM server
(`VLLMServerEngine`).

All are imported lazily (on first attribute access), so code that only needs the contract,
such as a producer wired to another engine, does not pay for importing transformers and peft.
"""

from miles.engines.base import FINISH_REASONS, Completion, LoraSettings, RolloutEngine

__all__ = ["FINISH_REASONS", "Completion", "HFEngine", "LoraSettings", "RolloutEngine",
           "VLLMEngine", "VLLMServerEngine"]


def __getattr__(name: str):
    if name == "HFEngine":
        from miles.engines.hf import HFEngine

        return HFEngine
    if name == "VLLMEngine":
        from miles.engines.vllm_engine import VLLMEngine

        return VLLMEngine
    if name == "VLLMServerEngine":
        from miles.engines.vllm_server import VLLMServerEngine

        return VLLMServerEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
