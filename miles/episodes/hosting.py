"""Where an episode's environment runs: its own thread and event loop, or the producer's loop.

Environments are user code, and an `async def step` that calls `time.sleep`, does CPU work or
uses a blocking client would block whichever event loop runs it. On the producer's loop that
stalls every episode and the Kafka heartbeats, and the per-step timeout cannot fire (it needs
the loop). So by default (`Environment.own_thread`) each episode's environment lives on an event
loop of its own in a daemon thread (`ThreadHost`): build, reset, step and close all run there
(loop-bound objects an environment makes, a subprocess or a client, keep working across its
calls), and the producer's loop awaits each call with the step timeout.

A thread cannot be killed. After a timeout the episode fails at once and the call's result is
discarded; the thread is *abandoned*: when the call returns, its loop runs `close` (bounded by
the same timeout, its result discarded) and ends. Abandoned threads still running are counted
(`abandoned_threads`, the heartbeat's `env_threads_stuck`) and bounded
(`MAX_ABANDONED_THREADS`): beyond it new episodes fail ("env_stuck") instead of starting more.

`LoopHost` runs an environment on the producer's loop (`own_thread = False`): no thread, and
an environment may share asyncio objects (a semaphore, a client) with the other episodes, but
one that blocks stalls everything. Cost of a thread (docs/environments.md): measured per call
and per episode in `tests/integration/test_env_hosting.py`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

MAX_ABANDONED_THREADS = 32  # timed-out environment threads still running; more: env_stuck

_abandoned_lock = threading.Lock()
_abandoned = 0


def abandoned_threads() -> int:
    """Environment threads abandoned after a timeout whose call has not returned yet."""
    return _abandoned


def _count_abandoned(delta: int) -> None:
    global _abandoned
    with _abandoned_lock:
        _abandoned += delta


async def _invoke(fn: Callable, args: tuple) -> Any:
    result = fn(*args)  # a sync method runs here, on the host's loop, like an async one
    return await result if inspect.isawaitable(result) else result


def runs_in_own_thread(factory: Callable) -> bool:
    """Whether the environments `factory` builds run on threads of their own (their class's
    `own_thread`; True when the factory does not say)."""
    target = getattr(factory, "func", factory)
    return bool(getattr(target, "own_thread", True))


class LoopHost:
    """An environment on the producer's loop (see the module docstring)."""

    stuck = False

    async def call(self, fn: Callable, *args: Any, timeout_s: float) -> Any:
        return await asyncio.wait_for(_invoke(fn, args), timeout_s)

    def release(self, close: Callable | None, timeout_s: float) -> None:
        """Nothing to release: `close` already ran through `call`."""


class ThreadHost:
    """An environment on its own daemon thread and event loop (see the module docstring)."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self.stuck = False  # a call timed out and may still be running there
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    async def call(self, fn: Callable, *args: Any, timeout_s: float) -> Any:
        """`fn(*args)` (awaited when it returns an awaitable) on this host's loop, within
        `timeout_s` of the caller's loop; on a timeout the host is stuck (TimeoutError)."""
        future = asyncio.run_coroutine_threadsafe(_invoke(fn, args), self.loop)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
        except TimeoutError:
            self.stuck = True  # cancelled there at its next await; a blocking call runs on
            raise

    def release(self, close: Callable | None, timeout_s: float) -> None:
        """End the thread. A stuck host is abandoned: once its call returns it runs `close`
        (if given, bounded by `timeout_s`, its result discarded) and then ends."""
        if not self.stuck:
            self.loop.call_soon_threadsafe(self.loop.stop)
            return
        _count_abandoned(1)
        log.warning("an environment call timed out and its thread %s still runs (%d abandoned "
                    "environment threads); it closes the environment when the call returns",
                    self._thread.name, abandoned_threads())
        asyncio.run_coroutine_threadsafe(self._close_and_stop(close, timeout_s), self.loop)

    async def _close_and_stop(self, close: Callable | None, timeout_s: float) -> None:
        try:
            if close is not None:
                await asyncio.wait_for(_invoke(close, ()), timeout_s)
        except Exception as err:  # user code after its episode failed: logged, discarded
            log.warning("closing an abandoned environment failed: %r", err)
        finally:
            _count_abandoned(-1)
            self.loop.stop()
