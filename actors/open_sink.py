"""Running a routing sink inside a Trio program, without the runtime's thread."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import trio

from taproute.actors.destination import DestinationSpec
from taproute.actors.routing_sink import RoutingSink
from taproute.routing.errors import RoutingFailure
from taproute.routing.routes import RoutingConfig
from taproute.routing.schema import RecordSchema


@asynccontextmanager
async def open_routing_sink(
    config: RoutingConfig,
    schema: RecordSchema,
    destinations: Mapping[str, DestinationSpec],
    default_destination: str | None = None,
    **kwargs: Any,
) -> AsyncIterator[RoutingSink]:
    """Run a :class:`RoutingSink` inside the calling Trio program (no thread).

    ::

        async with open_routing_sink(config, schema, {"capture": capture},
                                     default_destination="capture") as sink:
            await sink.submit(batch)
            await sink.flush()

    On normal exit the sink is closed (drained, flushed); the latched failure,
    if any, is raised.
    """
    sink = RoutingSink(config, schema, destinations, default_destination, **kwargs)
    error: BaseException | None = None
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        try:
            yield sink
        except BaseException as exc:
            # Raised below, after the nursery, so the caller sees its own
            # exception rather than an ExceptionGroup around it.
            error = exc
            nursery.cancel_scope.cancel()
        else:
            try:
                await sink.close()
            except RoutingFailure as exc:
                error = exc
    if error is not None:
        raise error
