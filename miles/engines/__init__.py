"""Rollout engines: one contract (`RolloutEngine`, `Completion`), a Hugging Face implementation.

`HFEngine` is imported lazily (on first attribute access), so code that only needs the contract,
such as a producer wired to another engine, does not pay for importing transformers and peft.
"""

from miles.engines.base import FINISH_REASONS, Completion, LoraSettings, RolloutEngine

__all__ = ["FINISH_REASONS", "Completion", "HFEngine", "LoraSettings", "RolloutEngine"]


def __getattr__(name: str):
    if name == "HFEngine":
        from miles.engines.hf import HFEngine

        return HFEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
