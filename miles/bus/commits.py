"""Commits of work that is done: offsets whose records have been fully handled (for a producer:
their groups published), committed after each batch and when the partitions are revoked.

A rebalance revokes partitions while a batch may be in flight. `on_revoked` waits for that batch
(at most `REVOKE_WAIT_S`), then commits what is done on the revoked partitions, so a member that
leaves gracefully, or one whose partitions move, hands them over with nothing to redo. A commit
the group refuses because its membership already changed (`CommitFailedError`) is logged in one
line and counted, never raised: the uncommitted records are re-delivered to the partition's new
owner (at-least-once). Any other bus error propagates.

`StreamOffsets` is the same for a streaming producer, whose records are taken one at a time and
finish in any order: a partition's commit is its lowest record still in flight, or, with none in
flight, the end of its last poll (records a poll dead-lettered or skipped are handled). A
revocation waits for the records in flight on the revoked partitions only.

Simplifications, chosen on purpose:
- One batch at a time (the producer's loop); `begin`/`done`/`abandon` bracket it, and no batch
  begins between a revocation and the next assignment (`revoking`).
- A streaming producer's record that finished above one still in flight is committed only once
  that one finishes: a member killed meanwhile has both generated again (at-least-once).
- A wait that times out commits only what is done; the batch still running is then redone by
  the partition's new owner, and its own commit later fails or covers partitions still held.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

from miles.bus.base import Consumer, Record, TopicPartition
from miles.errors import CommitFailedError

log = logging.getLogger(__name__)
REVOKE_WAIT_S = 30.0  # longest a revocation waits for the batch in flight (< the rebalance timeout)


class DoneOffsets:
    """Next offsets of handled records not committed yet, per partition."""

    def __init__(self) -> None:
        self.consumer: Consumer | None = None  # set once the consumer exists
        self.failures = 0  # commits refused because the group's membership changed
        self._done: dict[TopicPartition, int] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self._revoking = False

    @property
    def revoking(self) -> bool:
        """Between a revocation and the next assignment: records polled now are not handled
        (positions restart from the group's commit once the partitions are assigned)."""
        return self._revoking

    def begin(self) -> None:
        """A batch is in flight: a revocation waits for it."""
        self._idle.clear()

    def done(self, offsets: Mapping[TopicPartition, int]) -> None:
        """The batch ending at `offsets` (next offsets to read) is handled."""
        for tp, offset in offsets.items():
            self._done[tp] = max(self._done.get(tp, 0), offset)
        self._idle.set()

    def abandon(self) -> None:
        """The batch in flight will not be handled (rewound, or the loop stopped)."""
        self._idle.set()

    async def commit(self, tps: set[TopicPartition] | None = None) -> None:
        """Commit the done offsets of `tps` (None: all) that this member still holds."""
        held = self.consumer.assignment() if self.consumer is not None else set()
        offsets = {tp: o for tp, o in self._done.items()
                   if tp in held and (tps is None or tp in tps)}
        for tp in set(self._done) - held:
            del self._done[tp]  # moved away: its new owner starts at the group's commit
        if not offsets:
            return
        for tp in offsets:
            del self._done[tp]
        try:
            await self.consumer.commit(offsets)
        except CommitFailedError as err:
            self.failures += 1
            log.warning("commit refused after a rebalance; those prompts are re-delivered: %s",
                        err)

    async def on_assigned(self, assigned: set[TopicPartition]) -> None:
        """The bus's assignment callback: polled records can be handled again."""
        self._revoking = False

    async def on_revoked(self, revoked: set[TopicPartition]) -> None:
        """The bus's revocation callback: wait for the batch in flight, commit what is done."""
        self._revoking = True
        try:
            await asyncio.wait_for(self._idle.wait(), REVOKE_WAIT_S)
        except TimeoutError:
            log.warning("partitions revoked with a batch still in flight after %g s; its "
                        "prompts will be generated again", REVOKE_WAIT_S)
        await self.commit(revoked)


class StreamOffsets(DoneOffsets):
    """Done offsets of records finished in any order (see the module docstring): `take` each
    record as it starts (a ticket), `finish` the ticket once handled, and report each poll's
    end (`polled`). A ticket from before a revocation of its partition is stale: its record
    was handed over (or taken again), so finishing it changes nothing here."""

    def __init__(self) -> None:
        super().__init__()
        self._taken: dict[TopicPartition, set[int]] = {}  # offsets in flight
        self._polled: dict[TopicPartition, int] = {}  # next offset after the last poll
        self._position: dict[TopicPartition, int] = {}  # the last position marked done
        self._epochs: dict[TopicPartition, int] = {}  # revocations of each partition so far
        self._abandoned = False

    def take(self, record: Record) -> tuple[TopicPartition, int, int]:
        self._taken.setdefault(record.tp, set()).add(record.offset)
        return record.tp, record.offset, self._epochs.get(record.tp, 0)

    def finish(self, ticket: tuple[TopicPartition, int, int]) -> None:
        tp, offset, epoch = ticket
        if epoch != self._epochs.get(tp, 0):
            return
        self._taken.get(tp, set()).discard(offset)
        self._advance(tp)

    def polled(self, offsets: Mapping[TopicPartition, int]) -> None:
        """A poll ended at `offsets` (next offsets); the records it did not take are handled."""
        for tp, offset in offsets.items():
            self._polled[tp] = max(self._polled.get(tp, 0), offset)
            self._advance(tp)

    def in_flight(self, tps: set[TopicPartition] | None = None) -> int:
        return sum(len(offsets) for tp, offsets in self._taken.items()
                   if tps is None or tp in tps)

    def abandon(self) -> None:
        """The records in flight will not be handled (the producer is stopping or crashed): a
        revocation commits what is done without waiting for them."""
        self._abandoned = True

    def _advance(self, tp: TopicPartition) -> None:
        taken = self._taken.get(tp)
        position = min(taken) if taken else self._polled.get(tp, 0)
        if position > self._position.get(tp, 0):
            self._position[tp] = self._done[tp] = position

    async def on_revoked(self, revoked: set[TopicPartition]) -> None:
        """Wait for the records in flight on `revoked` (at most `REVOKE_WAIT_S`, not at all once
        abandoned), commit what is done there, and forget those partitions (a later assignment
        starts at the commit)."""
        self._revoking = True
        deadline = time.monotonic() + REVOKE_WAIT_S
        while self.in_flight(revoked) and not self._abandoned and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.in_flight(revoked):
            log.warning("partitions revoked with %d prompts still in flight; they will be "
                        "generated again", self.in_flight(revoked))
        await self.commit(revoked)
        for tp in revoked:
            for state in (self._taken, self._polled, self._position):
                state.pop(tp, None)
            self._epochs[tp] = self._epochs.get(tp, 0) + 1
