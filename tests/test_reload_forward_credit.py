"""Records a retired forward route handed to a destination are credited to that
route, not to a later route of the same name.

A destination reported what its sink took (or refused as closed) by route
*name*, and the routing sink looked the name up in the running generation
first.  A forward route removed by one reload and added back by the next
starts with fresh counters; records its predecessor had queued at a slow
destination, taken after the second swap, were counted as the new route's
``processed``: its account read ``accepted=0, delivered=3``, breaking
``accepted = delivered + dead_lettered + dropped + parked``.  And a record
refused by a closed destination was given up by whatever route held the name
then (a stateless one: its processor named in the dead letter, its
``failed`` counting records it never accepted).
"""

from __future__ import annotations

import numpy as np
import trio

from taproute.actors import open_routing_sink
from taproute.routing import HookRegistry, RecordFailure, Route, RoutingConfig, SinkClosed
from taproute.routing.batch import Batch
from tests.conftest import vec_batch
from tests.processors import SCHEMA
from tests.sinks import GateSink

Q = "layers.0.q"
OTHER = "layers.0.other"


def _hooks() -> tuple[HookRegistry, int]:
    hooks = HookRegistry()
    q = hooks.bind(Q, layout="vec")
    hooks.bind(OTHER, layout="vec")
    return hooks, q


class ClosedWhenOpened(GateSink):
    """Waits for ``gate``, then refuses as a closed destination does."""

    async def submit(self, batch: Batch) -> None:
        self.entered += 1
        await self.gate.wait()
        raise SinkClosed("the destination was closed")


async def _queue_then_reload_twice(sink, q: int, out: GateSink, back: Route) -> None:
    """Three records for gen 1's forward route "raw", held at the destination
    while gen 2 drops the route and gen 3 brings ``back`` under its name."""
    await sink.submit(vec_batch(q, 3))
    while not out.entered:  # the destination's submit holds them
        await trio.lowlevel.checkpoint()
    await sink.reload(RoutingConfig([Route("elsewhere", OTHER, "out")]))
    await sink.reload(RoutingConfig([back]))
    out.gate.set()
    await sink.flush()


async def test_records_taken_after_the_route_came_back_count_for_the_route_that_took_them():
    hooks, q = _hooks()
    out = GateSink()
    async with open_routing_sink(
        RoutingConfig([Route("raw", Q, "out")]), SCHEMA, {"out": out}, unmatched="drop", hooks=hooks
    ) as sink:
        await _queue_then_reload_twice(sink, q, out, Route("raw", Q, "out"))
        report = await sink.flush()
        account = report.routes["raw"]
        counters = sink.snapshot().routes["raw"]
    assert out.records == 3  # delivered, once
    # Generation 3's "raw" accepted nothing, so it delivered nothing.
    assert (account.accepted, account.delivered) == (0, 0)
    assert counters.processed == 0 and counters.emitted == 0
    out.clear()


async def test_records_refused_after_the_name_changed_mode_are_given_up_by_their_own_route():
    hooks, q = _hooks()
    out = ClosedWhenOpened()
    failures: list[RecordFailure] = []
    async with open_routing_sink(
        RoutingConfig([Route("raw", Q, "out")]),
        SCHEMA,
        {"out": out},
        unmatched="drop",
        hooks=hooks,
        on_failure=failures.append,
    ) as sink:
        stateless = Route("raw", Q, "out", mode="stateless", processor="test.norms")
        await _queue_then_reload_twice(sink, q, out, stateless)
        counters = sink.snapshot().routes["raw"]
    (failure,) = failures
    assert failure.code.value == "binding_invalid"
    assert len(failure.records) == 3 and np.all(failure.records.descriptors["seq"] == [0, 1, 2])
    # The forward route that accepted them gave them up: no processor named,
    # and generation 3's stateless route counts no failure it never accepted.
    assert failure.processor is None
    assert counters.accepted == 0 and counters.failed == 0
