"""The retry/park queue every processing route uses.

Records that failed for a retryable reason are *parked*: their buffer is held
(they count against the route's ``max_parked_records``) and an item is
scheduled to come back after the policy's backoff.  What comes back is up to
the route: a stateless pool re-queues the attempt itself, a stateful route
the failing key, whose head and followers its owner then tries in order.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, Generic, TypeVar

import trio

from taproute.actors.attempt import Attempt
from taproute.actors.counters import RouteCounters

T = TypeVar("T")


class RetryGate:
    """Holds back every route's retries while a flush counts (one per routing sink).

    A flush pauses retries, waits for those already started, flushes and
    takes its report: nothing moves between parked and delivered meanwhile,
    so the report is exact.  Retries falling due during the pause run after.
    """

    def __init__(self) -> None:
        self.paused = 0
        self._lot = trio.lowlevel.ParkingLot()

    @contextmanager
    def pause(self) -> Iterator[None]:
        """No retry starts inside this block."""
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1
            if not self.paused:
                self._lot.unpark_all()

    async def wait_open(self) -> None:
        """Return once no flush holds retries back."""
        while self.paused:
            await self._lot.park()


class RetryQueue(Generic[T]):
    """Parked records of one route and the items due to retry them.

    ``counters.parked`` is the number of records held; producers of new
    records wait in :meth:`wait_for_room` while it is at ``max_parked``.
    """

    def __init__(
        self, counters: RouteCounters, *, max_parked: int, gate: RetryGate | None = None
    ) -> None:
        self.counters = counters
        self._gate = gate if gate is not None else RetryGate()
        self.max_parked = max_parked
        self.closing = False
        self._due: list[tuple[float, int, T]] = []
        self._seq = itertools.count()
        self._wake = trio.lowlevel.ParkingLot()
        self._room = trio.lowlevel.ParkingLot()
        self._empty = trio.lowlevel.ParkingLot()

    # -- holding records -----------------------------------------------------

    def hold(self, attempt: Attempt) -> None:
        """Keep ``attempt``'s buffer while it waits (idempotent)."""
        if attempt.hold is None:
            attempt.hold = attempt.batch.retain()
            self.counters.parked += len(attempt.batch)
            attempt.note_settled(len(attempt.batch))

    def release(self, attempt: Attempt) -> None:
        """Give ``attempt``'s buffer back (idempotent); wakes producers waiting for room."""
        if attempt.hold is not None:
            attempt.hold.release()
            attempt.hold = None
            self.counters.parked -= len(attempt.batch)
            if self._room:
                self._room.unpark_all()
            if self._empty and self.counters.parked == 0:
                self._empty.unpark_all()

    async def wait_empty(self) -> None:
        """Return once no record is parked (each delivered, given up or discarded)."""
        while self.counters.parked > 0:
            await self._empty.park()

    def adopt(self, attempt: Attempt, source: RetryQueue[Any]) -> None:
        """Take over ``attempt``, held by ``source`` (a reload hands a retiring
        route's parked records to its successor): the buffer stays held, the
        parked count moves here (unless both queues count in the same counters)."""
        if attempt.hold is not None and source.counters is not self.counters:
            source.counters.parked -= len(attempt.batch)
            self.counters.parked += len(attempt.batch)
            if source._room:
                source._room.unpark_all()

    async def wait_for_room(self) -> None:
        """Backpressure: wait while too many records are parked (not once closing)."""
        while self.counters.parked >= self.max_parked and not self.closing:
            await self._room.park()

    # -- scheduling -------------------------------------------------------------

    def schedule(self, due: float, item: T) -> None:
        """Hand ``item`` back at trio time ``due``."""
        heapq.heappush(self._due, (due, next(self._seq), item))
        self._wake.unpark_all()

    async def run(self, retry: Callable[[T], Awaitable[None]]) -> None:
        """Call ``retry(item)`` as each item falls due, until :meth:`close`."""
        while not self.closing:
            if not self._due:
                await self._wake.park()
                continue
            due = self._due[0][0]
            if trio.current_time() < due:
                with trio.move_on_at(due):
                    await self._wake.park()
                continue
            if self._gate.paused:  # a flush is counting: after it
                await self._gate.wait_open()
                continue
            _, _, item = heapq.heappop(self._due)
            self.counters.retries += 1
            await retry(item)

    def close(self) -> None:
        """Stop :meth:`run`; producers no longer wait for room."""
        self.closing = True
        self._wake.unpark_all()

    def drain(self) -> list[T]:
        """Every item still scheduled, earliest first (at close: to give them up)."""
        items = [item for _, _, item in sorted(self._due, key=lambda entry: entry[:2])]
        self._due.clear()
        return items
