"""A routing sink's link to its park store: parked records made durable.

:class:`Parker` wraps a :class:`~taproute.routing.parking.ParkStore` (or
none: parking then stays in memory, as before stores existed) for the route
actors.  Every store call runs in a worker thread (a store that waits out
a lock another holder keeps on its file retries it there, see
:class:`~taproute.routing.parking.WaitsOutLocks`).  Records whose retry
succeeded are not forgotten at once: their output is only in a destination's
buffer then, so the destination actor forgets them once it has flushed that
output (``DestinationActor.settle``, which batches the deletes: up to 64,
or 1 s while batches keep coming).  A crash between that flush and the
delete retries them again after the restart: their output is then written
twice (at least once in that window; the README says why a deduplication
token would not close it).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from typing import TypeVar

import trio

from taproute.actors.attempt import Attempt
from taproute.actors.retry import RetryGate
from taproute.routing.failures import FailureCode
from taproute.routing.parking import ParkIds, Parking, ParkStore, Restored, WaitsOutLocks

T = TypeVar("T")


class Parker:
    """One running routing sink's use of a park store (``store`` None: in memory)."""

    def __init__(self, store: ParkStore | None) -> None:
        self.store = store
        #: This run's name in the store: what it parks is its own until it stops.
        self.run = uuid.uuid4().hex
        #: Every route's retries, held back while a flush counts.
        self.retries = RetryGate()

    async def _call(self, fn: Callable[..., T], *args: object, records: int = 0) -> T:
        """A store method in a worker thread; a store that waits out a lock
        another holder keeps on it (:class:`WaitsOutLocks`) runs it itself."""
        if isinstance(self.store, WaitsOutLocks):
            return await self.store.call(fn, *args, records=records)
        return await trio.to_thread.run_sync(fn, *args)

    @property
    def durable(self) -> bool:
        """True when parked records are kept in a store (they survive a crash)."""
        return self.store is not None

    async def keep(self, route: str, attempt: Attempt, *, waiting_behind: int | None) -> None:
        """Make ``attempt``'s records durable (new ones) or note their latest failure.

        ``waiting_behind``: the key whose failing record they wait behind (they
        did not fail themselves), else None.
        """
        store = self.store
        if store is None:
            return
        if attempt.park_ids is not None:
            if attempt.failures:
                await self._call(
                    store.failed_again,
                    attempt.park_ids,
                    attempt.failures,
                    attempt.last_failure_wall,
                    records=len(attempt.batch),
                )
            return
        if waiting_behind is None:
            assert attempt.code is not None
            code, error = attempt.code, f"{type(attempt.error).__name__}: {attempt.error}"
        else:
            code = FailureCode.HANDLER_FAILED
            error = f"waiting behind a failing record of key {waiting_behind}"
        parking = Parking(
            route=route,
            records=attempt.batch,
            code=code,
            error=error,
            failures=attempt.failures,
            first_failure_at=attempt.first_failure_wall,
            last_failure_at=attempt.last_failure_wall,
        )
        attempt.park_ids = await self._call(
            store.park, self.run, parking, records=len(attempt.batch)
        )

    async def unpark(self, ids: Sequence[int] | ParkIds) -> None:
        """Forget records now (given up, discarded, or delivered and flushed)."""
        if self.store is not None and len(ids):
            await self._call(self.store.unpark, ids)

    async def restore(self, routes: Sequence[str]) -> list[Restored]:
        """Records earlier runs left parked on ``routes``, oldest first."""
        if self.store is None:
            return []
        return await self._call(self.store.restore, self.run, list(routes))

    def release(self) -> None:
        """The run stopped: what it holds stays in the store for the next start."""
        if self.store is not None:
            self.store.release(self.run)


def restored_attempt(restored: Restored) -> Attempt:
    """An attempt for records a previous run parked, with their failure history.

    The give-up window keeps counting from the first failure's wall time.
    """
    now_wall = time.time()
    since = max(0.0, now_wall - restored.first_failure_at) if restored.failures else 0.0
    return Attempt(
        restored.records,
        failures=restored.failures,
        first_failure_at=trio.current_time() - since,
        first_failure_wall=restored.first_failure_at,
        last_failure_wall=restored.last_failure_at,
        park_ids=restored.ids,
    )
