"""A long-tail benchmark workload: a tiny model whose response length is set by its prompt.

Real RL rollouts have long-tailed response lengths (most answers short, a few 10-50x longer), which
is what makes a batch wait for its longest row. An untrained tiny model stops after a geometric
number of tokens (every token is EOS with about the same probability), so its lengths are not
long-tailed. This module builds one that is, for benchmarks and tests; it is a workload, not a
task: nothing is learnt or rewarded.

The model is the tiny Llama of `build_tiny_model` (same size, same forward, saved with
`save_pretrained` and loaded with `from_pretrained` like any checkpoint) with two matrices set by
hand so that it computes a chosen table of next-token logits given the current token:

- the input embeddings are orthonormal rows scaled far above what the untrained layers add to the
  residual stream, so the final norm's output is `sqrt(hidden) * q[current token]` (the logits
  below come out within ~0.003 of the table);
- the (untied) LM head is `table.T @ q / sqrt(hidden)`, so the logits are row `current` of
  `table` [V, V]: the current token again (logit 0), EOS with logit `log(h / (1 - h))`, anything
  else never (`NEVER`).

A response therefore repeats the prompt's last character until EOS, which ends it with probability
`h` per token: its length is geometric with mean `1 / h`. The digits 0..9 carry the difficulty:
digit d's mean length is `MIN_MEAN * (MAX_MEAN / MIN_MEAN) ** (d / 9)` (4 to 256 by default; other
characters take digit 0's). `long_tail_prompts` ends each prompt with a digit drawn with
probability proportional to `skew ** d`, so most prompts are easy and a few are 64x longer on
average: the mix of geometrics is heavy-tailed. The lengths it produces are measured in
`benchmarks/bench_streaming.py` and recorded in `docs/benchmarks.md`.

Simplifications, chosen on purpose: the tokens are trivial (a repeated character), since an
engine's cost per token does not depend on which token it samples; the vocabulary must fit in the
hidden size (orthonormal embeddings), which the plain character tokenizer (78) does at 128.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from miles.tasks.tiny_model import build_tiny_model

MIN_MEAN = 4.0  # mean response length of difficulty 0
MAX_MEAN = 256.0  # mean response length of difficulty 9
NEVER = -30.0  # logit of a token the workload never samples (e^-30 * 78 < 1e-11)
EMBED_SCALE = 1000.0  # embedding rms per entry, against ~0.1 added by the untrained layers
DIFFICULTIES = 10  # the digits 0..9


def mean_lengths(min_mean: float = MIN_MEAN, max_mean: float = MAX_MEAN) -> list[float]:
    """Mean response length of each difficulty digit: log-spaced from `min_mean` to `max_mean`."""
    ratio = max_mean / min_mean
    return [min_mean * ratio ** (d / (DIFFICULTIES - 1)) for d in range(DIFFICULTIES)]


def transition_logits(tokenizer, means: list[float]):
    """The next-token logits [V, V] given the current token (row): stay, or EOS with the stop
    probability of the current character's difficulty."""
    import torch

    vocab = len(tokenizer)
    table = torch.full((vocab, vocab), NEVER)
    table.fill_diagonal_(0.0)
    eos = tokenizer.eos_token_id
    for token_id in range(vocab):
        character = tokenizer.convert_ids_to_tokens(token_id)
        difficulty = int(character) if character.isdigit() else 0
        stop = 1.0 / means[difficulty]
        table[token_id, eos] = math.log(stop / (1.0 - stop))  # P(EOS) = stop against staying
    return table


def build_long_tail_model(out_dir: str | Path, *, min_mean: float = MIN_MEAN,
                          max_mean: float = MAX_MEAN, max_positions: int = 512,
                          seed: int = 0, **model) -> Path:
    """Write the workload's model and tokenizer to `out_dir` (see the module doc); `model` goes
    to `build_tiny_model` (hidden size, layers, ...)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not 1.0 < min_mean <= max_mean:
        raise ValueError(f"need 1 < min_mean <= max_mean, got {min_mean}, {max_mean}")
    out_dir = build_tiny_model(out_dir, max_positions=max_positions, seed=seed, tied=False, **model)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    net = AutoModelForCausalLM.from_pretrained(out_dir)
    vocab, hidden = len(tokenizer), net.config.hidden_size
    if vocab > hidden:
        raise ValueError(f"the workload needs hidden_size >= vocabulary ({vocab}), got {hidden}")
    generator = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(hidden, vocab, generator=generator)).Q.T  # [V, H]
    table = transition_logits(tokenizer, mean_lengths(min_mean, max_mean))  # [V, V]
    with torch.no_grad():
        net.get_input_embeddings().weight.copy_(basis * EMBED_SCALE * math.sqrt(hidden))
        net.get_output_embeddings().weight.copy_(table.T @ basis / math.sqrt(hidden))
    net.save_pretrained(out_dir)
    return out_dir


def long_tail_prompts(count: int, *, seed: int = 0, skew: float = 0.6) -> list[str]:
    """`count` prompts `q<i>:<d>`, the difficulty digit d drawn with probability proportional to
    `skew ** d` (`skew` < 1: most prompts easy, few hard)."""
    if not 0.0 < skew:
        raise ValueError(f"skew must be > 0, got {skew}")
    weights = np.array([skew ** d for d in range(DIFFICULTIES)])
    digits = np.random.default_rng(seed).choice(DIFFICULTIES, size=count, p=weights / weights.sum())
    return [f"q{i}:{d}" for i, d in enumerate(digits)]


def length_percentiles(lengths) -> dict[str, float]:
    """p50, p90, p99 and max of response lengths (tokens, EOS included)."""
    values = np.asarray(lengths, dtype=np.float64)
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "max": float(values.max())}
