"""The rollout engine contract: prompts in, sampled tokens with their behaviour logprobs out.

Every engine (in-process Hugging Face, vLLM) samples from exactly the distribution defined by
`miles.rl.sampling.process_logits`, and reports for each sampled token its logprob under that
processed distribution, so the trainer can score the same tokens with the same function.

Simplifications, chosen on purpose:
- The contract is blocking. Producers call it from a dedicated executor thread, never from the
  event loop; an engine serialises its own calls, so a weight load never lands mid-generation.
- Because of that, one `generate` call runs under one weight version, and each `Completion`
  carries that single `policy_version` (a response never spans an update inside one engine call).
- Token ids are plain lists in and numpy arrays out: the wire carries numpy arrays, and tensors
  would tie the contract to torch devices.
- Stop strings (`generate(..., stop_strings=)`, the end of a tool call in a multi-turn episode)
  end a response as soon as its decoded text contains one: the tokens sampled up to and
  including the one that completed it are kept (a stop string's characters are part of what the
  model sampled; a token that completes it and runs past it is kept whole), and the finish
  reason is "stop_string", the same name as `miles.envs.Action.finish_reason`. EOS wins when it
  is sampled; a stop string completed by the last token the budget allows is "stop_string".
  Requests without stop strings are untouched (the engines' fast paths stay as they were).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from miles.errors import ConfigError, EngineError
from miles.rl.sampling import SamplingParams

FINISH_REASONS = ("stop", "stop_string", "length")
""""stop": EOS sampled (and kept); "stop_string": the text reached one of the request's stop
strings (kept); "length": max_new_tokens hit. The wire's `Sample.finish_reason` has no
"stop_string": a producer records such a turn's episode as "stop"."""
MAX_STOP_STRINGS = 16  # a turn ends on any of these; more is a configuration mistake
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, kw_only=True)
class LoraSettings:
    """Shape of the LoRA adapter an engine serves; loaded adapters must match it."""

    r: int = 16  # rank of the low-rank update
    alpha: int = 32  # scaling numerator: the update is scaled by alpha / r
    dropout: float = 0.0  # dropout on the LoRA input (inactive in an engine, which runs in eval)
    target_modules: tuple[str, ...] = DEFAULT_LORA_TARGETS  # module names that get an adapter

    def __post_init__(self) -> None:
        if self.r < 1:
            raise ConfigError(f"r must be >= 1, got {self.r}")
        if self.alpha <= 0:
            raise ConfigError(f"alpha must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            raise ConfigError("target_modules must name at least one module")


@dataclass(frozen=True, kw_only=True, eq=False)
class Completion:
    """One sampled response. If `finish_reason == "stop"`, the last token is the EOS token; if
    "stop_string", the decoded tokens contain one of the request's stop strings (ending in the
    last token)."""

    token_ids: np.ndarray  # [T] int32
    logprobs: np.ndarray  # [T] float32, logprob of each token under the processed distribution
    finish_reason: str  # one of FINISH_REASONS
    policy_version: int  # weight version that sampled every token of this response

    def __post_init__(self) -> None:
        if self.token_ids.dtype != np.int32 or self.token_ids.ndim != 1:
            raise EngineError(f"token_ids must be int32 [T], got {self.token_ids.dtype} "
                              f"{self.token_ids.shape}")
        if self.logprobs.dtype != np.float32 or self.logprobs.shape != self.token_ids.shape:
            raise EngineError(f"logprobs must be float32 {self.token_ids.shape}, got "
                              f"{self.logprobs.dtype} {self.logprobs.shape}")
        if self.finish_reason not in FINISH_REASONS:
            raise EngineError(f"finish_reason must be one of {FINISH_REASONS}, "
                              f"got {self.finish_reason!r}")


def prompt_problem(prompt: list[int], vocab_size: int) -> str | None:
    """Why no engine of vocabulary `vocab_size` can take `prompt` (the prompt's fault, not the
    engine's: producers dead-letter such a prompt rather than retry it), or None."""
    if len(prompt) == 0:
        return "is empty"
    low, high = min(prompt), max(prompt)
    if low < 0 or high >= vocab_size:
        return f"has token ids outside [0, {vocab_size}) (from {low} to {high})"
    return None


def checked_stop_strings(stop_strings: tuple[str, ...]) -> tuple[str, ...]:
    """`stop_strings` as a tuple of non-empty strings, at most `MAX_STOP_STRINGS`; EngineError
    otherwise (a bare string would stop at each of its characters)."""
    if isinstance(stop_strings, str) or not all(isinstance(s, str) and s for s in stop_strings):
        raise EngineError(f"stop_strings must be a tuple of non-empty strings, got "
                          f"{stop_strings!r}")
    stops = tuple(stop_strings)
    if len(stops) > MAX_STOP_STRINGS:
        raise EngineError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    return stops


class RolloutEngine(abc.ABC):
    """A policy that samples responses and hot-loads new weight versions.

    `policy_version` is the version of the weights currently loaded; it starts at 0 (the weights
    the engine was built with) and is set by each successful load.
    """

    name: str  # engine kind as recorded on the wire, e.g. "hf"
    max_stop_strings: int = MAX_STOP_STRINGS  # most stop strings one request may carry

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Size of the logits dimension; every sampled token id is below it."""

    @property
    @abc.abstractmethod
    def eos_token_id(self) -> int:
        """The token that ends a response (`finish_reason == "stop"`)."""

    @property
    @abc.abstractmethod
    def policy_version(self) -> int:
        """Version of the weights currently loaded."""

    @property
    def context_limit(self) -> int | None:
        """Most tokens one sequence may hold, prompt and response together (None: unknown).
        A request past it is refused (vLLM) or leaves the positions the model was trained on
        (hf), so callers keep `len(prompt) + max_new_tokens` within it."""
        return None

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without special tokens."""

    @abc.abstractmethod
    def decode(self, token_ids: list[int] | np.ndarray) -> str:
        """Text of `token_ids`, special tokens dropped."""

    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams, *,
                 seed: int | None = None,
                 stop_strings: tuple[str, ...] = ()) -> list[list[Completion]]:
        """`params.n` completions for each prompt, in prompt order; a response also ends when its
        decoded text contains one of `stop_strings` (see the module docstring). Blocking."""

    @abc.abstractmethod
    def load_adapter(self, adapter_dir: Path, policy_version: int, *,
                     new_lineage: bool = False) -> None:
        """Apply a peft-saved LoRA adapter (`adapter_model.safetensors` + `adapter_config.json`).

        An engine may refuse a `policy_version` not above the loaded one, unless `new_lineage`
        (a resumed trainer's version: the loaded weights belong to a fenced generation). On any
        error the current weights and `policy_version` stay as they were. Blocking.
        """

    def load_full_weights(self, weights: Path, policy_version: int) -> None:
        """Replace all weights from a model directory or a single `.safetensors` file. Blocking."""
        raise NotImplementedError(f"engine {self.name!r} cannot load full weights")

    def load_version(self, folder: Path, policy_version: int, fmt: str, *,
                     new_lineage: bool = False) -> None:
        """Load a weight store folder written in format `fmt` ("lora" or "full"); `new_lineage`
        as for `load_adapter`. Blocking."""
        if fmt == "lora":
            self.load_adapter(folder, policy_version, new_lineage=new_lineage)
        else:
            self.load_full_weights(folder, policy_version)

    def close(self) -> None:
        """Release what the engine holds outside this process (vLLM: its engine core)."""


class TokenizedEngine(RolloutEngine):
    """What engines with a local Hugging Face tokenizer share: they set `tokenizer`,
    `_vocab_size`, `_eos_token_id` and `_policy_version` and get the accessors and the text
    conversions here."""

    tokenizer: object
    _vocab_size: int
    _eos_token_id: int
    _policy_version: int = 0

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_token_id(self) -> int:
        return self._eos_token_id

    @property
    def policy_version(self) -> int:
        return self._policy_version

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, token_ids: list[int] | np.ndarray) -> str:
        return self.tokenizer.decode(list(map(int, token_ids)), skip_special_tokens=True)

    def _check_prompts(self, prompts: list[list[int]]) -> None:
        """EngineError for an empty prompt or token ids outside the vocabulary."""
        for i, prompt in enumerate(prompts):
            if (problem := prompt_problem(prompt, self._vocab_size)) is not None:
                raise EngineError(f"prompt {i} {problem}")
