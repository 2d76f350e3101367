"""Reward functions: `fn(response: str, reference: str | None) -> float`.

`resolve_reward` accepts a built-in name or `package.module:function`. The producer calls
rewards on decoded text cut at the end-of-sequence token; a reward that raises marks that sample
(its reason recorded in `Sample.error`, reward 0.0) and never stops the producer.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from miles.errors import ConfigError

RewardFn = Callable[[str, str | None], float]


def exact_match(response: str, reference: str | None) -> float:
    """1.0 when the response, stripped of surrounding whitespace, equals the reference."""
    if reference is None:
        raise ValueError("exact_match needs a reference answer")
    return 1.0 if response.strip() == reference.strip() else 0.0


BUILTIN_REWARDS: dict[str, RewardFn] = {"exact_match": exact_match}


def resolve_reward(name: str) -> RewardFn:
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    module_name, sep, attr = name.partition(":")
    if not sep:
        raise ConfigError(f"reward must be one of {sorted(BUILTIN_REWARDS)} or "
                          f"package.module:function, got {name!r}")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"reward {name!r} cannot be imported: {err}") from err
    if not callable(fn):
        raise ConfigError(f"reward {name!r} is not callable")
    return fn
