"""Forward routes: the batch goes to the destination as it is."""

from __future__ import annotations

from taproute.actors.route_actor import RouteActor
from taproute.routing.batch import RecordBatch


class ForwardRoute(RouteActor):
    """Hands batches to the destination as they are: no copy, no actor hop of its own
    (a route that narrows Float32 records to BFloat16 hands on a narrowed copy
    of those, see :mod:`taproute.routing.narrowing`).

    A record counts as processed (and emitted) once the destination's sink
    took it; one the sink refused because it is closed is failed instead;
    one in a submit the sink raised on (a failure, latched: any exception
    but cancellation, ``SystemExit`` included) is given up, and counted by
    the destination too (``failed_records``).  Never two of them, so
    ``processed + failed + given_up`` is what the route was given once its
    destination handled it (a shutdown's cut counts what it gives up at the
    destination, ``abandoned_records``).
    """

    async def dispatch(self, batch: RecordBatch, *, wait: bool = True) -> None:
        # A destination actor never waits on a route, so waiting here cannot
        # close a cycle: ``wait`` only matters for routes with mailboxes.
        self.counters.accepted += len(batch)
        handed = [0]  # records handed to the destination (counted there on)
        try:
            narrowing = self.planned.narrowing
            for part in [batch] if narrowing is None else narrowing.apply(batch):
                # The route itself, not its name: told what the sink took of these
                # even once a reload gave the name to another route.
                await self.destination.deliver(self, part)
                handed[0] += len(part)
                if self.chain is not None:
                    self.counters.derived += await self.chain.records(part)
        except Exception as exc:
            self._cut_dispatch(len(batch), handed, exc)

    def taken(self, records: int) -> None:
        """The destination's sink took ``records`` of this route's records."""
        self.counters.processed += records
        self.counters.emitted += records

    def not_taken(self, records: int) -> None:
        """The destination's sink raised on ``records`` of this route's records
        (a failure, latched there): given up."""
        self.counters.given_up += records
