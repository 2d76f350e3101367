"""Rollout engines: one contract (`RolloutEngine`, `Completion`), a Hugging Face implementation
(`HFEngine`) and a client of a running vLLM server (`VLLMServerEngine`).

Both are imported lazily (on first attribute access), so code that only needs the contract,
such as a producer wired to another engine, does not pay for importing transformers and peft.
"""

from miles.engines.base import FINISH_REASONS, Completion, LoraSettings, RolloutEngine

__all__ = ["FINISH_REASONS", "Completion", "HFEngine", "LoraSettings", "RolloutEngine",
           "VLLMServerEngine"]


def __getattr__(name: str):
    if name == "HFEngine":
        from miles.engines.hf import HFEngine

        return HFEngine
    if name == "VLLMServerEngine":
        from miles.engines.vllm_server import VLLMServerEngine

        return VLLMServerEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
