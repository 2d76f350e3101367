"""Reward functions, built in or plugged in, and the `Scorer` producers call them through.

A reward spec (the `reward` setting) is one of:
- `exact_match`: 1.0 when the stripped response equals the stripped reference;
- `math`: the final answer (last `\\boxed{}`, else after "answer is"/"Answer:"/"####", else the
  last number) equals the reference as an exact number or a normalised string (`answers`);
- `format` or `format:REGEX`: 1.0 when the whole response matches the pattern, by default
  `<think>...</think> <answer>...</answer>` (`matching.DEFAULT_FORMAT`);
- `rm:PATH`: a Hugging Face sequence-classification checkpoint's logit for prompt + response
  (`reward_model`);
- `api:NAME`: a callable handed to `miles.train` in this process (`register_reward`);
- `package.module:function`: any plugin, `fn(response, reference) -> float`, sync or async,
  optionally `@batched` and optionally taking the prompt text (`scorer` says how); the module
  names `format` and `rm` are taken by the built-ins above.
The producer scores decoded text cut at the end-of-sequence token. A reward that raises, times
out (`reward_timeout_s`) or returns a non-finite value marks that sample (reward 0.0, the reason in
`Sample.error`) and never stops the producer.
"""

from __future__ import annotations

from collections.abc import Callable

from miles.errors import ConfigError
from miles.plugins import import_object
from miles.tasks.rewards.answers import math_answer
from miles.tasks.rewards.matching import FormatReward, exact_match
from miles.tasks.rewards.scorer import DEFAULT_TIMEOUT_S, Scored, Scorer, batched, inline

__all__ = ["BUILTIN_REWARDS", "DEFAULT_TIMEOUT_S", "Scored", "Scorer", "batched", "inline",
           "exact_match", "math_answer", "register_reward", "resolve_reward"]

BUILTIN_REWARDS: dict[str, Callable] = {"exact_match": exact_match, "math": math_answer,
                                        "format": FormatReward()}
"""Rewards named by the spec alone; `format:REGEX` and `rm:PATH` take an argument."""
REGISTERED: dict[str, Callable] = {}  # `api:NAME` -> a callable given to `miles.train`


def register_reward(fn: Callable) -> str:
    """Name `fn` for this process (a reward callable not importable by name); the spec."""
    spec = f"api:{getattr(fn, '__name__', 'reward')}-{len(REGISTERED)}"
    REGISTERED[spec] = fn
    return spec


def resolve_reward(spec: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> Scorer:
    """The `Scorer` for reward `spec` (see the module docstring); ConfigError if it is unusable."""
    return Scorer(reward_function(spec), timeout_s=timeout_s, name=spec)


def reward_function(spec: str) -> Callable:
    """The function behind `spec`: a built-in, a built-in with an argument, or a plugin."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    prefix, sep, rest = spec.partition(":")
    if sep and prefix == "format":
        return FormatReward(rest)
    if sep and prefix == "api":
        if spec not in REGISTERED:
            raise ConfigError(f"reward {spec!r} was registered by another process (miles.train "
                              "runs a callable reward on the embedded bus only)")
        return REGISTERED[spec]
    if sep and prefix == "rm":
        from miles.tasks.rewards.reward_model import RewardModel

        return RewardModel(rest)
    if not (sep and prefix and rest):
        raise ConfigError(f"reward must be one of {sorted(BUILTIN_REWARDS)}, format:REGEX, "
                          f"rm:PATH or package.module:function, got {spec!r}")
    return _import_plugin(spec)


def _import_plugin(spec: str) -> Callable:
    fn = import_object(spec, kind="reward")
    if not callable(fn):
        raise ConfigError(f"reward {spec!r} is not callable (a {type(fn).__name__})")
    return fn
