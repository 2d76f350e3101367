"""The weights a producer follows: announced versions checked, the newest that loads loaded.

The producer's control loop hands each announced `WeightVersion` to `offer` and calls
`load_newest` whenever `load_due`; the engine work and the reporting stay the producer's
(`apply`, `reject`). A version is loaded after checking that its file is inside the weight store
(`miles.weights.store`) with the announced size and sha256. The versions followed are the newest
trainer generation's (`miles.weights.following`): a resumed trainer's are loaded even when lower,
a fenced trainer's refused. An announced version is a candidate until it loads: one that fails is
reported and dropped and changes nothing (not the followed version, not the trainer's version
admission uses), so the producer keeps generating with the weights it has and keeps following the
real versions after a forged one. With `public_key` set, versions, commands and trainer
heartbeats must carry the trainer's Ed25519 signature (`miles.weights.signing`); an unsigned or
badly signed one is refused before it changes anything, counted in `producer/unverified` (and
versions in `weight_errors`).

A newest version that does not load (a missing file, an unreachable engine) falls back to the
newest one that does, and such versions are retried every `WEIGHT_RETRY_S`, so a lost file or a
server restart costs freshness, not the run; `failures` says which, for the producer's
admission to report while it waits.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path

from miles.errors import EngineUnavailableError, MilesError
from miles.protocol import WeightVersion
from miles.weights.following import Announcements, FollowConfig, lineage, may_load_later
from miles.weights.signing import Verifier
from miles.weights.store import fetch_version

log = logging.getLogger(__name__)
WEIGHT_RETRY_S = 10.0  # pause before retrying versions that failed to load (files reappear)

Apply = Callable[[Path, WeightVersion, bool], Awaitable[float]]  # folder, version, new lineage
Reject = Callable[[WeightVersion, str], Awaitable[None]]  # a version not loaded, and why


class WeightFollower:
    """A producer's candidates, loaded weights and missing-file retries. `apply` loads a fetched
    folder into the engine (seconds it took there); `reject` counts and reports a version that
    is not loaded; `counts` is the producer's (`producer/unverified`, `weight_loads`, `load_s`)."""

    def __init__(self, config: FollowConfig, *, base_model: str, counts: dict[str, float],
                 apply: Apply, reject: Reject):
        self.config = config
        self.base_model = base_model  # versions for another base are rejected ("": any base)
        self.counts = counts
        self.verifier = Verifier(config.public_key, who="producer")
        self.announced = Announcements()  # the followed version and the candidates
        self._apply, self._reject = apply, reject
        self._loaded = (0, 0)  # lineage (generation, policy version) of the engine's weights
        self._failed: set[tuple[int, int]] = set()  # candidates that may load later
        self._retry_at = 0.0  # monotonic time to retry the versions that failed
        self._unreachable = False  # the last load failed because the engine was unreachable
        self.load_latencies: deque[float] = deque(maxlen=1000)  # announce -> in use, seconds

    def unverified(self, record, what: str) -> bool:
        """True (counted, logged) when `record` fails signature verification."""
        why = self.verifier.refusal(record)
        if why is not None:
            self.counts["producer/unverified"] += 1
            log.warning("ignoring %s: %s", what, why)
        return why is not None

    async def offer(self, value: WeightVersion) -> None:
        """Note an announced version as a candidate; the control loop loads the newest
        (`Announcements` says which versions may be: the newest trainer generation's, going
        forward). Nothing else changes until it loads."""
        why = self.verifier.refusal(value)
        if why is not None:
            self.counts["producer/unverified"] += 1
        else:
            why = self.announced.refusal(value)
        if why is None and self.base_model and value.base_model != self.base_model:
            why = (f"made for base model {value.base_model!r}, this producer serves "
                   f"{self.base_model!r}")
        if why is not None:
            await self._reject(value, why)
            return
        self.announced.offer(value)

    def load_due(self) -> bool:
        newer = self.announced.newer_than(self._loaded)
        return (any(lineage(v) not in self._failed for v in newer)
                or bool(newer) and time.monotonic() >= self._retry_at)

    async def load_newest(self) -> WeightVersion | None:
        """Load the newest candidate that loads, trying newer ones first (a missing or broken
        file falls back to the one before); the version loaded, if any. A candidate whose file
        is missing is reported once and retried every `WEIGHT_RETRY_S` (its file may appear),
        never in a busy loop."""
        retry = time.monotonic() >= self._retry_at
        newer = self.announced.newer_than(self._loaded)
        self._failed &= {lineage(v) for v in self.announced.candidates}
        loaded = None
        self._unreachable = False
        for version in newer:
            failed_before = lineage(version) in self._failed
            if (retry or not failed_before) and await self._load(version,
                                                                 report=not failed_before):
                loaded = version
                break
            if self._unreachable:  # the engine, not the version: older ones would fail alike
                break
        self._retry_at = time.monotonic() + WEIGHT_RETRY_S
        return loaded

    async def _load(self, version: WeightVersion, *, report: bool = True) -> bool:
        """Fetch, verify and apply `version`; a failure is rejected (reported) if `report`. A
        missing file or an unreachable engine keeps the candidate for a retry; any other failure
        drops it."""
        new_lineage = version.trainer_generation > self._loaded[0]  # may go back in number
        began = time.perf_counter()
        try:
            folder = await asyncio.to_thread(fetch_version, version,  # generation goes on
                                             self.config.store)
            fetch_s = time.perf_counter() - began
            apply_s = await self._apply(folder, version, new_lineage)
        except MilesError as err:
            self._unreachable = isinstance(err, EngineUnavailableError)
            if may_load_later(err):
                self._failed.add(lineage(version))
            else:
                self.announced.drop(version)
            if report:
                await self._reject(version, str(err))
            else:
                log.info("version %d still does not load: %s", version.policy_version, err)
            return False
        self._loaded = lineage(version)
        self.announced.verified(version)
        self.counts["producer/load_s"] += fetch_s + apply_s  # not the wait behind a generate
        self.load_latencies.append(max(time.time() - version.created_at, 0.0))
        self.counts["producer/weight_loads"] += 1
        log.info("loaded policy version %d", version.policy_version)
        return True

    def failures(self) -> str | None:
        """Which candidates newer than the loaded weights failed to load, and when they are
        retried (None: none)."""
        failed = [v.policy_version for v in self.announced.newer_than(self._loaded)
                  if lineage(v) in self._failed]
        if not failed:
            return None
        return (f"versions {', '.join(map(str, failed))} failed to load, retried "
                f"every {WEIGHT_RETRY_S:g} s")

    def load_latency_p50(self) -> float | None:
        """Median seconds from a version's announcement to its use, over the last 1000 loads."""
        return statistics.median(self.load_latencies) if self.load_latencies else None
