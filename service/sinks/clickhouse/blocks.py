"""What a ClickHouse sink keeps per table: the buffer a block accumulates in
between two inserts, and the table's counters."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import attrs
import trio

from taproute.routing.batch import Batch, Retained


@attrs.define
class TableCounters:
    """Per table: rows and bytes inserted, inserts done, retries, failed
    attempts, rows waiting in the buffer and rows being inserted now, and rows
    whose insert :meth:`~taproute.service.sinks.clickhouse.ClickHouseSink.close`
    stopped waiting for with no owner to take them (not known to be written)."""

    table: str
    records: int = 0
    bytes: int = 0
    inserts: int = 0
    retries: int = 0
    errors: int = 0
    buffered_rows: int = 0
    in_flight_rows: int = 0
    abandoned_rows: int = 0


class InsertAbandoned(TimeoutError):
    """An insert a sink stopped waiting for (``close_timeout``): the server
    did not finish it in time.  Its rows are not known to be written; an
    owner with a spool takes them (and repeats them under the same token)."""


class HeldAttempt:
    """A block's insert attempts, and who gives the producers' buffers back:
    the sink when its task ends, unless an attempt it stopped waiting for
    still runs in its thread, which then gives them back when it returns
    (it reads those buffers).  An attempt that had not started when the sink
    stopped waiting does nothing.  Several may run at once (a retry after an
    attempt abandoned because the server stopped answering, which runs on
    in its thread): the last of them to return gives the buffers back."""

    __slots__ = ("_abandoned", "_holds", "_lock", "_returned", "_running", "tried")

    def __init__(self, holds: list[Retained], returned: Callable[[], None] | None = None) -> None:
        self._holds = holds
        self._lock = threading.Lock()
        self._running = 0  # attempts running in their threads
        self._abandoned = False
        #: Called (in the attempt's thread) when an attempt the sink stopped
        #: waiting for returns.
        self._returned = returned
        #: An attempt started (the block may have been written).
        self.tried = False

    def run(self, fn: Callable[..., None], *args: object) -> None:
        """``fn(*args)`` in the attempt's thread, unless the sink stopped waiting."""
        with self._lock:
            if self._abandoned:
                return
            self._running += 1
        try:
            fn(*args)
        finally:
            with self._lock:
                self._running -= 1
                release = self._abandoned and self._running == 0
            if release:
                self._release()
                if self._returned is not None:
                    self._returned()

    def finish(self) -> bool:
        """The sink's task is done with the block: give the buffers back now,
        or leave that to an attempt still running (True: one runs, and will
        call ``returned`` when it does)."""
        with self._lock:
            self._abandoned = True
            if self._running:
                return True
        self._release()
        return False

    def _release(self) -> None:
        holds, self._holds = self._holds, []
        for hold in holds:
            hold.release()


class TableOrder:
    """The order a table's sealed blocks may start in: block ``i`` (counted
    from 0 as sealed) starts only once every block before ``i - ahead + 1``
    is done (written, given up, or handed to the owner).

    So while a block is not done (its first try running, or its retries:
    written or not, unknown), at most ``ahead - 1`` blocks sealed after it
    start, and at most ``ahead - 1`` sealed before it still run: no more
    than ``2 * ahead - 1`` inserts land between its first try and its last
    repeat, itself included, which is what the table's deduplication window
    must hold (:func:`inserts_between_repeats`).  An owner that takes
    failed blocks over repeats them in this order; one the table refused
    is moved behind the blocks tried beside it (:meth:`requeue`)."""

    __slots__ = ("_done", "_lot", "ahead", "done_below", "sealed")

    def __init__(self, ahead: int) -> None:
        self.ahead = ahead
        self.sealed = 0
        #: Every block below this index is done.
        self.done_below = 0
        self._done: set[int] = set()
        self._lot = trio.lowlevel.ParkingLot()

    def seal(self) -> int:
        """The next block's index."""
        self.sealed += 1
        return self.sealed - 1

    async def wait_turn(self, index: int, *, behind_all: bool = False) -> None:
        """Return once block ``index`` may start (``behind_all``: once every
        block before it is done)."""
        below = index if behind_all else index - self.ahead + 1
        while self.done_below < below:
            await self._lot.park()

    def requeue(self, index: int) -> int:
        """Block ``index`` gives up its place and is sealed again behind every
        block sealed so far; returns its new index (it is done at the old one).

        For a block the table refused (nothing of it written) that the owner
        takes over: it goes to the owner behind the blocks tried beside it,
        so that their repeats (a try whose outcome is unknown) come before
        the inserts the owner splits the refused block into (each a block of
        its own in the deduplication window: spooled ahead of such a repeat,
        enough of them pushed its first try out of the window, and its rows
        were written twice).  The blocks sealed before it and not tried yet
        go ahead of it too."""
        self.done(index)
        return self.seal()

    def done(self, index: int) -> None:
        self._done.add(index)
        while self.done_below in self._done:
            self._done.remove(self.done_below)
            self.done_below += 1
        self._lot.unpark_all()


def inserts_between_repeats(inserts_in_flight: int) -> int:
    """The inserts into one table that may land between a block's first try
    and its last repeat, that one included (see :class:`TableOrder`)."""
    return 2 * max(1, inserts_in_flight) - 1


class TableBuffer:
    """What one table has accumulated since its last insert."""

    __slots__ = ("bytes", "first_at", "holds", "items", "rows")

    def __init__(self) -> None:
        self.items: list[Batch] = []
        self.holds: list[Retained] = []
        self.rows = 0
        self.bytes = 0
        self.first_at = math.inf


__all__ = [
    "HeldAttempt",
    "InsertAbandoned",
    "TableBuffer",
    "TableCounters",
    "TableOrder",
    "inserts_between_repeats",
]
