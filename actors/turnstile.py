"""A FIFO mutual-exclusion gate for Trio tasks that costs nothing when free.

``trio.StrictFIFOLock`` yields to the scheduler on every acquire.  The record
worker takes the routing sink's gate once per batch, and a yield there lets
every destination actor run on one message at a time; without it, actors
drain their mailboxes in bulk.  Waiting (and cancellation while waiting)
works as with a lock.
"""

from __future__ import annotations

from types import TracebackType

import trio


class Turnstile:
    """Admits one task at a time, in arrival order; free entry does not yield."""

    __slots__ = ("_held", "_waiting")

    def __init__(self) -> None:
        self._held = False
        self._waiting = trio.lowlevel.ParkingLot()

    async def __aenter__(self) -> None:
        if self._held:
            # release() hands the turnstile straight to the first waiter.
            await self._waiting.park()
        else:
            self._held = True

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._waiting:
            self._waiting.unpark()
        else:
            self._held = False

    @property
    def held(self) -> bool:
        """True while some task is inside."""
        return self._held
