"""Rewards for tests, importable as `tests.rewards:NAME` by producer processes."""

import asyncio
import math
import time

from miles.tasks.rewards import batched


def starts_with_digit(response: str, reference: str | None) -> float:
    """A reward an untrained model earns sometimes, so advantages are not all zero."""
    return float(response[:1].isdigit())


def digit_for_odd_answers(response: str, reference: str | None) -> float:
    """0 whenever the reference answer is even (such groups have equal rewards by design),
    `starts_with_digit` otherwise."""
    odd = bool(reference) and reference[-1] in "13579"
    return starts_with_digit(response, reference) if odd else 0.0


def slow(response: str, reference: str | None) -> float:
    """Sleeps when the response says "slow" (far past any test's timeout), else 1.0."""
    if response == "slow":
        time.sleep(30)
    return 1.0


async def async_length(response: str, reference: str | None, *, prompt: str) -> float:
    """Length of prompt + response, computed on the event loop; "hang" never finishes."""
    if response == "hang":
        await asyncio.Event().wait()
    return float(len(prompt + response))


@batched
def batched_match(responses: list[str], references: list[str | None]) -> list[float]:
    """exact_match over a batch; a reference "short" makes it return one value too few."""
    values = [float(r == ref) for r, ref in zip(responses, references)]
    return values[:-1] if "short" in references else values


@batched
async def async_batched_prompts(responses: list[str], references: list[str | None], *,
                                prompts: list[str]) -> list[float]:
    """The index of each response's prompt in `PROMPT_ORDER`; "nan" scores NaN."""
    return [math.nan if r == "nan" else float(PROMPT_ORDER.index(p))
            for r, p in zip(responses, prompts)]


PROMPT_ORDER = ["a", "b", "c"]


def failing(response: str, reference: str | None) -> float:
    """Raises on "boom", returns infinity on "inf", None on "none", else 0.5."""
    if response == "boom":
        raise KeyError("boom")
    return {"inf": math.inf, "none": None}.get(response, 0.5)


NOT_CALLABLE = 3
