"""The face a ClickHouse sink shows an owner that keeps its own durable queue
(a spooling destination): failed blocks handed over instead of retried here
(:meth:`~OwnerInserts.hand_over_failures`), batches inserted at once without
buffering or retry (:meth:`~OwnerInserts.insert_now`), and the backlog the
owner watches.

:class:`OwnerInserts` is that part of
:class:`~taproute.service.sinks.clickhouse.sink.ClickHouseSink`, which sets
the state declared here.
"""

from __future__ import annotations

from collections.abc import Sequence

import trio

from taproute.routing.batch import Batch
from taproute.routing.latch import FailureLatch
from taproute.service.sinks.clickhouse.abandonable import AbandonableCalls
from taproute.service.sinks.clickhouse.blocks import TableBuffer, TableCounters
from taproute.service.sinks.clickhouse.handover import HandsOverToOwner, PartlyInserted
from taproute.service.sinks.clickhouse.liveness import run_watched
from taproute.service.sinks.clickhouse.transport import Transport, connection_failure


class OwnerInserts(HandsOverToOwner):
    """Hand-over of failed blocks and direct inserts, for a sink's owner."""

    transport: Transport
    _calls: AbandonableCalls
    counters: dict[str, TableCounters]
    _latch: FailureLatch
    _abandoned_running: dict[str, int]
    _attempts_returned: trio.lowlevel.ParkingLot

    def _by_table(self, batch: Batch) -> list[tuple[str, Batch]]:
        raise NotImplementedError

    def _insert_blocking(self, table: str, buffer: TableBuffer, token: str) -> None:
        raise NotImplementedError

    async def _hand_over(self, table: str, buffer: TableBuffer, token: str, exc: Exception) -> None:
        assert self._failed_blocks is not None
        try:
            await self._failed_blocks(list(buffer.items), token, exc)
        except Exception as handler_error:
            self._latch.latch(
                handler_error,
                destination=f"clickhouse table {table!r}",
                where=f"handing over a failed insert of {buffer.rows} rows",
            )

    async def insert_now(self, batches: Sequence[Batch], token: str) -> None:
        """Insert ``batches`` at once, one block per table, with tokens derived from ``token``.

        For a wrapper that keeps its own durable queue (the spool): no
        buffering and no retry here; a failure is raised, not latched, and
        :meth:`is_transient` says whether the same call may succeed later.
        A repeat with the same ``token`` and batches writes nothing twice,
        and neither does a repeat of a block this sink sealed and handed over
        (:meth:`hand_over_failures`) with that block's token.  When a later
        table fails after an earlier one was stored, :class:`PartlyInserted`
        says which parts were not.  Cancelling the caller abandons the
        insert in progress (its thread runs on within the transport's
        timeouts, its outcome dropped): the owner keeps the batches and
        repeats them under ``token`` later (a spool's drain at close).

        A table's part waits while an insert of the table that this sink
        stopped waiting for still runs in its thread (a flush's ``within``,
        :meth:`hand_over_unfinished`): that try may still land, and a repeat
        of it, or anything after it, must not land first, or the try could
        land with its block gone from the deduplication window.
        """
        parts: dict[str, TableBuffer] = {}
        for batch in batches:
            for table, part in self._by_table(batch):
                parts.setdefault(table, TableBuffer()).items.append(part)
        for done, (table, buffer) in enumerate(parts.items()):
            while self._abandoned_running.get(table):
                await self._attempts_returned.park()
            try:
                await run_watched(
                    self.transport, self._calls.call, self._insert_blocking, table, buffer, token
                )
            except Exception as exc:
                if done == 0:
                    raise
                rest = [item for b in list(parts.values())[done:] for item in b.items]
                raise PartlyInserted(rest, exc) from exc
            counters = self.counters[table]
            counters.inserts += 1
            counters.records += sum(len(item) for item in buffer.items)
            counters.bytes += sum(item.nbytes for item in buffer.items)

    def is_transient(self, error: BaseException) -> bool:
        """True when retrying a failed :meth:`insert_now` may succeed."""
        if isinstance(error, PartlyInserted):
            error = error.cause
        return self.transport.is_transient(error)

    def describe_failure(self, error: BaseException) -> str:
        """A failed insert in one line for the owner's health report: an
        unreachable server as ``unreachable: <server>: <reason>``."""
        if isinstance(error, PartlyInserted):
            error = error.cause
        reason = connection_failure(error)
        if reason is not None:
            return f"unreachable: {self.transport.description}: {reason}"
        return f"{type(error).__name__}: {error}"


__all__ = ["OwnerInserts"]
