"""When a run (`miles run`) is over: a bound is met, the data is used up, or a daemon failed.

The data is used up once (1) the producers' group has committed every record of the prompts
topic, so every group they will publish is on the trajectories topic (a producer commits a
prompt only after publishing its group), and then (2) the trainer's newest heartbeat counts as
consumed every record of the trajectories topic: each was trained, dropped, filtered or
dead-lettered, or waits in a step that can no longer fill up. Trainer heartbeats count only
when signed by the run's trainer key (a forged one must not end a run).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from miles.bus import Bus
from miles.bus.decoding import DecodingConsumer
from miles.errors import MilesError
from miles.protocol import Heartbeat
from miles.protocol.topics import topic_name
from miles.service import wait_or_stop
from miles.weights.signing import Verifier

if TYPE_CHECKING:
    from miles.evaluation import Evaluator

POLL_S = 1.0


class RunWatch:
    """Reads the status topic (from its end) for the trainer's heartbeats; use `async with`."""

    def __init__(self, bus: Bus, run: str, public_key: Path | None,
                 on_beat: Callable[[dict], None] | None = None):
        self.bus = bus
        self.run = run
        self.on_beat = on_beat  # called with each verified trainer heartbeat's counters
        self.verifier = Verifier(public_key, who="run watch")
        self.trainer: dict = {}  # the newest verified trainer heartbeat's counters
        self._status: DecodingConsumer | None = None

    async def __aenter__(self) -> RunWatch:
        consumer = self.bus.consumer([topic_name(self.run, "status")],
                                     group_id=f"miles.{self.run}.run-watch.status",
                                     from_beginning=False)
        await consumer.start()
        self._status = DecodingConsumer(self.bus, consumer, expected=Heartbeat,
                                        dlq_topic=topic_name(self.run, "dlq"), name="run-watch")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._status.consumer.close()

    async def read_status(self, wait_s: float = 0.0) -> None:
        for item in await self._status.poll(timeout_s=wait_s):
            beat = item.value
            if beat.role == "trainer" and self.verifier.refusal(beat) is None:
                self.trainer = dict(beat.extra)
                if self.on_beat is not None:
                    self.on_beat(self.trainer)

    async def until_started(self, evaluator: Evaluator, stop: asyncio.Event,
                            failed: Callable[[], str | None] = lambda: None,
                            trainer_done: Callable[[], bool] = lambda: False) -> None:
        """Until the trainer has announced a version and some producer has sent a heartbeat
        (it does once its engine is built), or the trainer has exited (a short or resumed run
        can meet `max_steps` before this process reads either); before the evaluator follows
        the run."""
        while not stop.is_set() and (evaluator.announced < 0 or not evaluator.producers_seen):
            if trainer_done():
                await evaluator.read_topics()  # what the daemons said before it exited
                return
            _raise_if(failed())
            await evaluator.read_topics(wait_s=0.2)

    async def until_done(self, stop: asyncio.Event, max_seconds: float,
                         trainer_done: Callable[[], bool],
                         failed: Callable[[], str | None] = lambda: None) -> str:
        """Wait for the first end; what it was: stopped, max_steps, max_seconds or data."""
        deadline = time.monotonic() + max_seconds if max_seconds else math.inf
        while True:
            _raise_if(failed())
            await self.read_status()
            if stop.is_set():
                return "stopped"
            if trainer_done():
                return "max_steps"
            if time.monotonic() >= deadline:
                return "max_seconds"
            if await self.used_up():
                return "data"
            await wait_or_stop(stop, min(POLL_S, max(deadline - time.monotonic(), 0)))

    async def used_up(self) -> bool:
        prompts, trajectories = (topic_name(self.run, kind) for kind in ("prompts",
                                                                           "trajectories"))
        fed = sum(end for _, end in (await self.bus.topic_offsets([prompts])).values())
        committed = (await self.bus.group_offsets([prompts])).get(
            f"miles.{self.run}.producers", {})
        if not fed or sum(committed.values()) < fed:
            return False
        published = sum(end for _, end in (await self.bus.topic_offsets([trajectories])).values())
        await self.read_status()  # a beat sent after the prompts were all committed
        return self.trainer.get("consumed", -1) >= published


def _raise_if(failure: str | None) -> None:
    if failure is not None:
        raise MilesError(f"the run failed: {failure} (its log is in out_dir)")
