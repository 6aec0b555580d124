"""Destination actors: one per destination sink, fed through a mailbox.

The actor is the only caller of its sink's ``submit``, so a sink never sees
two calls at once.  Whatever happens, every message's lease is returned and
its in-flight count removed, so buffers go back and flush never hangs.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import attrs
import trio

from taproute.actors.counters import DestinationCounters
from taproute.actors.inflight import InFlight
from taproute.actors.latch import FailureLatch
from taproute.actors.mailbox import Mailbox
from taproute.routing.batch import Batch, RecordBatch, RowBatch
from taproute.routing.errors import SinkClosed
from taproute.routing.sink import RecordSink

#: A destination actor drains queued batches without a scheduler trip for each
#: (a hop costs more than the work); it still yields this often.
_YIELD_EVERY = 64

#: Called with (route, batch, error) for raw records a closed destination refused.
Undeliverable = Callable[[str, RecordBatch, BaseException], Awaitable[None]]

#: (route name or None for unmatched records, batch)
DestinationMessage = tuple[str | None, Batch]


class DestinationActor:
    """Owns the submit side of one :class:`RecordSink`.

    ``owned`` sinks (created by the routing sink) are closed by :meth:`close`;
    leased ones are only flushed.
    """

    def __init__(
        self,
        name: str,
        sink: RecordSink,
        *,
        owned: bool,
        latch: FailureLatch,
        in_flight: InFlight,
        capacity_records: int,
        capacity_bytes: int,
        undeliverable: Undeliverable | None = None,
    ) -> None:
        self.name = name
        self.sink = sink
        self.owned = owned
        self.counters = DestinationCounters(name)
        self._latch = latch
        self._in_flight = in_flight
        self._undeliverable = undeliverable
        self.mailbox: Mailbox[DestinationMessage] = Mailbox(
            f"destination {name}", capacity_records=capacity_records, capacity_bytes=capacity_bytes
        )

    async def deliver(self, route: str | None, batch: Batch) -> None:
        """Queue ``batch`` for the sink, taking a lease on raw batches.

        Waits while the mailbox is full.
        """
        if isinstance(batch, RecordBatch):
            batch.lease.acquire()
        self._in_flight.add()
        try:
            await self.mailbox.send((route, batch), records=len(batch), nbytes=batch.nbytes)
        except BaseException:
            self._finished(batch)
            raise

    async def run(self) -> None:
        """Submit every queued batch, in order, until the mailbox is closed."""
        handled = 0
        while True:
            handled += 1
            if handled % _YIELD_EVERY == 0:
                await trio.lowlevel.checkpoint()  # stay fair to other actors
            try:
                route, batch = await self.mailbox.receive()
            except trio.EndOfChannel:
                return
            try:
                await self.sink.submit(batch)
            except SinkClosed as exc:
                # The destination is gone: a per-record failure of the route
                # (binding_invalid, dead-lettered), not a failure of the router.
                self.counters.errors += 1
                if self._undeliverable is None or route is None or isinstance(batch, RowBatch):
                    self._latch.latch(exc, route=route, destination=self.name, where="submit")
                else:
                    await self._undeliverable(route, batch, exc)
            except Exception as exc:
                self.counters.errors += 1
                self._latch.latch(exc, route=route, destination=self.name, where="submit")
            else:
                self.counters.records += len(batch)
                self.counters.bytes += batch.nbytes
                self.counters.batches += 1
            finally:
                self._finished(batch)

    def _finished(self, batch: Batch) -> None:
        try:
            if isinstance(batch, RecordBatch):
                batch.lease.release()
        except Exception as exc:
            self._latch.latch(exc, destination=self.name, where="buffer release callback")
        finally:
            self._in_flight.done()

    async def flush(self) -> None:
        """Flush the sink; a failure is latched and raised."""
        try:
            await self.sink.flush()
        except Exception as exc:
            self.counters.errors += 1
            raise self._latch.latch(exc, destination=self.name, where="flush") from exc
        self.counters.flushes += 1

    async def close(self) -> None:
        """Close the sink if the routing sink created it; a failure is latched and raised."""
        if not self.owned:
            return
        try:
            await self.sink.close()
        except Exception as exc:
            self.counters.errors += 1
            raise self._latch.latch(exc, destination=self.name, where="close") from exc

    def snapshot(self) -> DestinationCounters:
        """A detached copy of the counters."""
        self.counters.queue_depth = self.mailbox.records
        return attrs.evolve(self.counters)
