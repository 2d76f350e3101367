"""The sampling distribution, defined once for the engine that samples and the trainer that scores.

Importance ratios are only exact when the behaviour logprob of a token (recorded by the engine)
and the trainer's logprob of it come from the same distribution. Both sides therefore call
`process_logits`: divide by the temperature, keep the `top_k` largest logits, keep the smallest
set of tokens whose probability reaches `top_p`, renormalise. Removed tokens get -inf, so a sampled
token always has a finite logprob.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How responses are sampled; travels with each group as `TrajectoryGroup.sampling`."""

    n: int = 8  # responses per prompt
    temperature: float = 1.0
    top_p: float = 1.0  # 1.0 disables nucleus filtering
    top_k: int = 0  # 0 disables top-k filtering
    max_new_tokens: int = 16

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ConfigError(f"n must be >= 1, got {self.n}")
        if not self.temperature > 0:
            raise ConfigError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    def as_wire(self) -> dict[str, float | int]:
        return {"n": self.n, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k, "max_new_tokens": self.max_new_tokens}


def process_logits(logits: torch.Tensor, *, temperature: float, top_k: int = 0,
                   top_p: float = 1.0) -> torch.Tensor:
    """Logits of the distribution actually sampled from (`[..., V]` in, same shape out)."""
    logits = logits.float() / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # [..., V]: mass of strictly better tokens
        drop_sorted = mass_before >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sampled_logprobs(logits: torch.Tensor, tokens: torch.Tensor, *, temperature: float,
                     top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Logprob of `tokens` ([...]) under the processed distribution of `logits` ([..., V])."""
    processed = process_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    return processed.log_softmax(dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
