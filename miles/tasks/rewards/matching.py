"""Rewards that match text: `exact_match` against the reference, and a format check."""

from __future__ import annotations

import re

from miles.errors import ConfigError
from miles.tasks.rewards.scorer import inline

DEFAULT_FORMAT = r"\s*<think>.*?</think>\s*<answer>\s*\S.*?</answer>\s*"
"""Reasoning in <think> tags, then a non-empty <answer>, and nothing else but whitespace."""


@inline
def exact_match(response: str, reference: str | None) -> float:
    """1.0 when the response, stripped of surrounding whitespace, equals the reference."""
    if reference is None:
        raise ValueError("exact_match needs a reference answer")
    return 1.0 if response.strip() == reference.strip() else 0.0


class FormatReward:
    """1.0 when the whole response matches `pattern` (`re.fullmatch`, `.` matching newlines
    too), else 0.0; the reference is not used. The spec `format` uses `DEFAULT_FORMAT`,
    `format:REGEX` its own pattern, e.g. `format:.*\\\\boxed\\{.+\\}.*` for a boxed answer."""

    def __init__(self, pattern: str = DEFAULT_FORMAT):
        try:
            self.pattern = re.compile(pattern, re.DOTALL)
        except re.error as err:
            raise ConfigError(f"reward format:{pattern!r} is not a regular expression: {err}"
                              ) from err

    def __call__(self, response: str, reference: str | None) -> float:
        return 1.0 if self.pattern.fullmatch(response) else 0.0
