"""Retry parking that survives a crash: the store a route keeps parked records in.

A record that failed for a retryable reason waits for its retry *parked*; on
a stateful route the later records of its key wait behind it.  Without a
store they wait only in memory, so a crash after ``flush()`` returned would
lose records ``flush()`` had acknowledged.  With a :class:`ParkStore` every
parked or waiting record is written to it before the route finishes handling
the message that parked it, so a ``flush()`` covers it; it leaves the store
when it is given up (the failure handler has it) or once its retry's output
was flushed to the destination.  At the next start, records still in the
store are *restored* to their routes and tried again, in their parked order
(per key, in arrival order).

The protocol is small and synchronous: routes call it in worker threads.
``taproute.service.ops.parking.ParkedRecords`` implements it in the
dead-letter store's SQLite file.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol, TypeVar, runtime_checkable

import attrs
import numpy as np
import numpy.typing as npt

from taproute.routing.batch import RecordBatch
from taproute.routing.failures import FailureCode

#: One park id per record (int64), aligned with the records of a batch.
ParkIds = npt.NDArray[np.int64]


@attrs.frozen(kw_only=True, eq=False)
class Parking:
    """Records to keep: what they are, which route holds them, and why.

    ``failures`` is 0 for records that did not fail themselves but wait
    behind a failing record of their key; ``first_failure_at`` and
    ``last_failure_at`` are wall-clock seconds (0 when they never failed).
    """

    route: str
    records: RecordBatch
    code: FailureCode
    error: str
    failures: int
    first_failure_at: float
    last_failure_at: float


@attrs.frozen(kw_only=True, eq=False)
class Restored:
    """Records a previous run left parked on ``route``, in parked order, with
    their park ids and failure history (one group shares one history)."""

    route: str
    records: RecordBatch
    ids: ParkIds
    failures: int
    first_failure_at: float
    last_failure_at: float


@runtime_checkable
class ParkStore(Protocol):
    """Where parked records are kept durably (thread-safe; called from worker threads).

    ``run`` names one running routing sink: records it parks are its own, and
    :meth:`restore` hands a new run only records no live run in this process
    holds (a reload's next generation must not take the running one's).
    """

    def park(self, run: str, parking: Parking) -> ParkIds:
        """Keep ``parking.records`` durably (one transaction); their ids, in order."""
        ...

    def failed_again(self, ids: ParkIds, failures: int, last_failure_at: float) -> None:
        """Note another failure of parked records (their history survives a restart)."""
        ...

    def unpark(self, ids: Sequence[int] | ParkIds) -> None:
        """Forget these records (given up, discarded, or their output flushed)."""
        ...

    def restore(self, run: str, routes: Sequence[str]) -> list[Restored]:
        """Take over the records of ``routes`` no live run holds, oldest first."""
        ...

    def release(self, run: str) -> None:
        """``run`` stopped: what it still holds stays parked for the next start."""
        ...


T = TypeVar("T")


@runtime_checkable
class WaitsOutLocks(Protocol):
    """A store whose writes may find it locked for a while by another holder
    (an operator's session on its file): it runs its own blocking methods
    in a worker thread and tries again while it is locked, within its own
    bound, instead of failing at once."""

    def call(self, fn: Callable[..., T], *args: object, records: int = 0) -> Awaitable[T]:
        """``fn(*args)`` in a worker thread, waiting out a lock (``records``:
        how many records wait in this write, for the store's status)."""
        ...


__all__ = ["ParkIds", "ParkStore", "Parking", "Restored", "WaitsOutLocks"]
