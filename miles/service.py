"""Running a long-lived asyncio service: signals, the stop event, the event loop.

The first SIGINT/SIGTERM sets the stop event: loops finish the unit of work in hand (a
generation batch, a train step), flush and commit, and return. A second signal cancels the main
task, which still runs its `finally`/`async with` clean-ups. Daemons run on uvloop where it is
installed (it speeds up the Kafka client's many small callbacks), else on asyncio's own loop.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import signal
from collections.abc import Awaitable, Callable
from typing import TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # every command's log lines
PR_SET_PDEATHSIG = 1


def configure_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(level=level, format=LOG_FORMAT)


def die_with_parent() -> None:
    """In a child process before it runs (`preexec_fn`): SIGKILL when the parent dies (Linux),
    so a killed run leaves no daemon or learner behind to race the resumed one."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


async def run_until_stopped(main: Callable[[asyncio.Event], Awaitable[T]],
                            stop: asyncio.Event | None = None) -> T:
    """Run `main(stop)`; SIGINT/SIGTERM set `stop` once, then cancel."""
    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    task = asyncio.ensure_future(main(stop))

    def on_signal(signum: int) -> None:
        if not stop.is_set():
            log.warning("%s: draining (send again to stop at once)", signal.Signals(signum).name)
            stop.set()
        else:
            log.warning("%s again: stopping now", signal.Signals(signum).name)
            task.cancel()

    handled = (signal.SIGINT, signal.SIGTERM)
    for signum in handled:
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        return await task
    finally:
        for signum in handled:
            loop.remove_signal_handler(signum)


def run_service(main: Callable[[asyncio.Event], Awaitable[T]]) -> T:
    """Run `main(stop)` to completion on a fresh event loop (uvloop if available)."""
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(run_until_stopped(main))


async def wait_or_stop(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep up to `seconds`, waking early on stop; True if stop is set."""
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except TimeoutError:
        pass
    return stop.is_set()


def daemon_main(settings_cls: type, argv, *, prog: str, doc: str,
                run: Callable[[object, asyncio.Event], Awaitable[dict]]) -> int:
    """The `main` of a daemon configured by `--config`/`--set`: logging, settings (logged),
    `run(settings, stop)` until it returns or a signal stops it, its summary logged."""
    import json

    from miles.config import log_config, parse_config_args

    configure_logging()
    settings = parse_config_args(settings_cls, argv, prog=prog,
                                 description=doc.splitlines()[0])
    log_config(settings)
    summary = run_service(lambda stop: run(settings, stop))
    logging.getLogger(prog).info("stopped: %s", json.dumps(summary, default=str))
    return 0
