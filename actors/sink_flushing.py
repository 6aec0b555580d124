"""How a routing sink reaches a consistent point: :meth:`flush` (drain the
routes, flush the destinations, optionally wait until nothing is parked and
every spool has drained, and report where each record is), and, at start,
handing the routes what a previous run left in the park store.

:class:`SinkFlushing` is that part of
:class:`~taproute.actors.routing_sink.RoutingSink`; the sink sets every
attribute it uses in its constructor and ``run``.  Both take the sink's lock,
so they are ordered with the batches submitted around them.
"""

from __future__ import annotations

from taproute.actors.accounting import flush_report
from taproute.actors.forward import ForwardRoute
from taproute.actors.sink_operations import SinkOperations
from taproute.routing.errors import FlushCutOff
from taproute.routing.flush_report import FlushReport


class SinkFlushing(SinkOperations):
    """Flush and park-store restore of a routing sink."""

    #: Routes a shutdown's grace cut off (the routing sink sets it).
    _routes_cut: bool

    async def flush(self, *, wait: bool = False) -> FlushReport:
        """Wait until every route and pool has drained, then flush every destination.

        Returns once every record submitted before it is delivered (in the
        destinations, or durable in a destination's spool), dead-lettered,
        dropped by a counted policy, or parked for a retry (durable when the
        sink has a park store); the :class:`FlushReport` says how many are in
        which state.  ``wait=True`` also waits until nothing is parked (each
        retried to success or given up) and every spool has drained.  Raises
        the first latched failure.
        """
        self._check_open()
        async with self._lock:
            if wait:
                await self._wait_unparked()
            # A route a reload retired drains (its parked records retried) before
            # it hands over: with retries paused first, that wait never ended.
            await self._in_flight.wait_idle()
            with self._parker.retries.pause():  # the report is one consistent moment
                await self._drain_and_flush(wait=wait)
                snapshot = self.snapshot()
        return flush_report(snapshot, parked_durable=self._parker.durable, waited=wait)

    async def _wait_unparked(self) -> None:
        while True:
            await self._in_flight.wait_idle()
            self._latch.raise_if_failed()
            routes = self._gen.routes  # a retired route's parked records are in flight
            for route in routes:
                await route.parked.wait_empty()
            if self._in_flight.count == 0 and all(r.counters.parked == 0 for r in routes):
                return

    async def _drain_and_flush(self, *, wait: bool = False) -> None:
        await self._in_flight.wait_idle()
        self._latch.raise_if_failed()
        for actor in self._destinations.values():
            await actor.flush()
            if wait:
                await actor.wait_delivered()
        self._latch.raise_if_failed()
        self._raise_if_cut()

    def _raise_if_cut(self) -> None:
        """A flush that a shutdown's grace overtook did not deliver what it
        covers: what the cut routes and destinations held was given up."""
        cut = [
            f"destination {name!r} (in {actor.counters.cut_short or 'nothing'})"
            for name, actor in self._destinations.items()
            if actor.is_cut
        ]
        if self._routes_cut:
            cut.insert(0, "the routes still processing")
        if cut:
            raise FlushCutOff(
                "flush: the shutdown grace ran out and cut off "
                + ", ".join(cut)
                + "; what they held was given up, not delivered"
            )

    async def _restore_parked(self) -> None:
        """Hand the routes what a previous run left in the park store (in parked
        order), before any new record: they are tried again at once."""
        try:
            parking = [r.name for r in self._gen.routes if not isinstance(r, ForwardRoute)]
            restored = await self._parker.restore(parking)
        except Exception as exc:
            self._latch.latch(exc, where="park store (restoring parked records)")
            return
        async with self._lock:
            for records in restored:
                await self._gen.by_name[records.route].restore(records)
