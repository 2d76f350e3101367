"""`Scorer`: calls one reward function, whatever its shape, under a per-call timeout.

A reward is `fn(response, reference) -> float`, plain or `async def`. Marked `@batched` it is
`fn(responses, references) -> list[float]` instead, one call for a whole group. Either kind may
also take the prompt text as a keyword, `prompt=` (`prompts=` when batched); it is passed only
when the function's signature names it (inspected once, when the `Scorer` is built).

`Scorer.score` never raises for a reward's fault: a call that raises, times out, or returns a
non-finite number (or a batch of the wrong length) gives its samples reward 0.0 and an `error`,
which the producer records in `Sample.error`. Choices:
- Sync functions run in a fresh daemon thread per call, async ones on the event loop; a call
  gets `timeout_s` from when it starts. Python cannot kill a thread, so a timed-out sync call
  keeps running in the background until it returns by itself (its result is dropped); being a
  daemon thread it never holds up the process's exit. A reward that hangs for good leaks one
  thread per call: fix the reward, the timeout only keeps the producer going meanwhile.
- Per-sample calls of one `score` run at most `concurrency` at a time (default 8), so a sync
  reward must be thread-safe (pure functions are). A function that is not can be made
  `@batched`: one call per `score`, in one thread.
- A sync function marked `@inline` (the built-ins `exact_match` and `math`) is called directly
  on the event loop, with no thread and no timeout: starting a thread costs ~0.1 ms, which for
  a microsecond-cheap reward over 256 samples per batch is a large share of the producer's
  time. Mark only cheap functions that cannot hang.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from miles.errors import ConfigError

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_CONCURRENCY = 8


@dataclass(frozen=True)
class Scored:
    """The reward of one response; `error` says why it is 0.0 when the reward failed."""

    reward: float
    error: str | None = None


def batched(fn: Callable) -> Callable:
    """Mark `fn(responses, references) -> list[float]` as a batched reward."""
    fn.batched = True
    return fn


def inline(fn: Callable) -> Callable:
    """Mark a cheap sync reward that cannot hang: called on the event loop, no timeout."""
    fn.inline = True
    return fn


class Scorer:
    """Wraps reward `fn` (see the module docstring); `score` is what producers call."""

    def __init__(self, fn: Callable, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 concurrency: int = DEFAULT_CONCURRENCY, name: str | None = None):
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ConfigError(f"reward_timeout_s must be > 0 and finite, got {timeout_s}")
        if concurrency < 1:
            raise ConfigError(f"reward concurrency must be >= 1, got {concurrency}")
        self.fn = fn
        self.name = name or getattr(fn, "__qualname__", type(fn).__name__)
        self.timeout_s = timeout_s
        self.batched = bool(getattr(fn, "batched", False))
        self.is_async = _is_async(fn)
        self.inline = bool(getattr(fn, "inline", False)) and not self.is_async
        self.prompt_keyword = "prompts" if self.batched else "prompt"
        self.takes_prompt = _accepts_keyword(fn, self.prompt_keyword)
        self._concurrency = concurrency

    def __repr__(self) -> str:
        kind = ("async " if self.is_async else "") + ("batched" if self.batched else "per-sample")
        return f"Scorer({self.name}, {kind}, timeout_s={self.timeout_s:g})"

    async def score(self, responses: Sequence[str], references: Sequence[str | None],
                    prompts: Sequence[str]) -> list[Scored]:
        """One `Scored` per response, in order; never raises for the reward's fault."""
        if not len(responses) == len(references) == len(prompts):
            raise ValueError(f"score needs equal lengths, got {len(responses)} responses, "
                             f"{len(references)} references, {len(prompts)} prompts")
        if not responses:
            return []
        if self.batched:
            return await self._score_batch(list(responses), list(references), list(prompts))
        if self.inline:
            return [self._score_inline(*args) for args in zip(responses, references, prompts)]
        limit = asyncio.Semaphore(self._concurrency)

        async def one(response: str, reference: str | None, prompt: str) -> Scored:
            async with limit:
                return await self._score_one(response, reference, prompt)

        return list(await asyncio.gather(*map(one, responses, references, prompts)))

    def _score_inline(self, response: str, reference: str | None, prompt: str) -> Scored:
        extra = {"prompt": prompt} if self.takes_prompt else {}
        try:
            return _checked(self.fn(response, reference, **extra))
        except Exception as err:  # noqa: BLE001 - a reward must never stop the producer
            return Scored(0.0, _failure(err))

    async def _score_one(self, response: str, reference: str | None, prompt: str) -> Scored:
        extra = {"prompt": prompt} if self.takes_prompt else {}
        value, error = await self._guarded_call(response, reference, **extra)
        return Scored(0.0, error) if error else _checked(value)

    async def _score_batch(self, responses: list[str], references: list[str | None],
                           prompts: list[str]) -> list[Scored]:
        extra = {"prompts": prompts} if self.takes_prompt else {}
        values, error = await self._guarded_call(responses, references, **extra)
        if error is None:
            try:
                values = list(values)
            except TypeError as err:
                error = f"reward failed: batched reward returned {type(values).__name__}: {err}"
        if error is None and len(values) != len(responses):
            error = f"reward returned {len(values)} values for {len(responses)} responses"
        if error:
            return [Scored(0.0, error)] * len(responses)
        return [_checked(v) for v in values]

    async def _guarded_call(self, *args: Any, **kwargs: Any) -> tuple[Any, str | None]:
        """(the reward's return value, None), or (None, why it failed or timed out)."""
        deadline = asyncio.timeout(self.timeout_s)
        try:
            async with deadline:
                if self.is_async:
                    return await self.fn(*args, **kwargs), None
                return await in_daemon_thread(self.fn, *args, **kwargs), None
        except TimeoutError as err:
            if deadline.expired():
                return None, f"reward timed out after {self.timeout_s:g} s"
            return None, _failure(err)
        except Exception as err:  # noqa: BLE001 - a user reward must never stop the producer
            return None, _failure(err)


def _failure(err: BaseException) -> str:
    return f"reward failed: {type(err).__name__}: {err}"


def _checked(value: Any) -> Scored:
    """`value` as a finite float reward, or an error naming what was wrong with it."""
    try:
        reward = float(value)
    except (TypeError, ValueError) as err:
        return Scored(0.0, _failure(err))
    if not math.isfinite(reward):
        return Scored(0.0, f"reward is not finite: {reward}")
    return Scored(reward)


async def in_daemon_thread(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` in a new daemon thread; cancelling the wait abandons the thread.

    Also what tools (`miles.envs.tools`) run sync functions with, for the same reasons.
    """
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    name = getattr(fn, "__name__", "fn")

    def settle(result: Any, error: BaseException | None) -> None:
        if done.done():  # the caller stopped waiting (timeout or cancellation)
            return
        if error is None:
            done.set_result(result)
        else:
            done.set_exception(error)

    def work() -> None:
        try:
            outcome = (fn(*args, **kwargs), None)
        except StopIteration as err:  # a future cannot hold StopIteration
            outcome = (None, RuntimeError(f"{name} raised StopIteration: {err}"))
        except BaseException as err:  # noqa: BLE001 - handed to the awaiting coroutine
            outcome = (None, err)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the event loop closed while the reward ran: nobody waits
            return

    threading.Thread(target=work, name=f"call-{name}",
                     daemon=True).start()
    return await done


def _is_async(fn: Callable) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None))


def _accepts_keyword(fn: Callable, name: str) -> bool:
    """Whether `fn` has a parameter `name` that can be passed by keyword."""
    try:
        parameter = inspect.signature(fn).parameters.get(name)
    except (TypeError, ValueError):  # some builtins have no signature
        return False
    return parameter is not None and parameter.kind in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
