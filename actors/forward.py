"""Forward routes: the batch goes to the destination as it is."""

from __future__ import annotations

from taproute.actors.route_actor import RouteActor
from taproute.routing.batch import RecordBatch


class ForwardRoute(RouteActor):
    """Hands batches to the destination as they are: no copy, no actor hop of its own."""

    async def dispatch(self, batch: RecordBatch) -> None:
        self.counters.processed += len(batch)
        self.counters.emitted += len(batch)
        await self.destination.deliver(self.name, batch)
