"""What a ClickHouse sink keeps per table: the buffer a block accumulates in
between two inserts, and the table's counters."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import attrs

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
    stopped waiting does nothing."""

    __slots__ = ("_abandoned", "_holds", "_lock", "_running")

    def __init__(self, holds: list[Retained]) -> None:
        self._holds = holds
        self._lock = threading.Lock()
        self._running = False
        self._abandoned = False

    def run(self, fn: Callable[..., None], *args: object) -> None:
        """``fn(*args)`` in the attempt's thread, unless the sink stopped waiting."""
        with self._lock:
            if self._abandoned:
                return
            self._running = True
        try:
            fn(*args)
        finally:
            with self._lock:
                self._running = False
                release = self._abandoned
            if release:
                self._release()

    def finish(self) -> None:
        """The sink's task is done with the block: give the buffers back now,
        or leave that to an attempt still running."""
        with self._lock:
            self._abandoned = True
            if self._running:
                return
        self._release()

    def _release(self) -> None:
        holds, self._holds = self._holds, []
        for hold in holds:
            hold.release()


class TableBuffer:
    """What one table has accumulated since its last insert."""

    __slots__ = ("bytes", "first_at", "holds", "items", "rows")

    def __init__(self) -> None:
        self.items: list[Batch] = []
        self.holds: list[Retained] = []
        self.rows = 0
        self.bytes = 0
        self.first_at = math.inf


__all__ = ["HeldAttempt", "InsertAbandoned", "TableBuffer", "TableCounters"]
