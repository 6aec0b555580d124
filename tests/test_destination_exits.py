"""A destination's sink raising ``SystemExit`` (any exception but cancellation)
in its submit is the destination's failure: its records are given up,
counted once, and the next flush raises the failure naming the destination.

Before, only ``Exception`` was the sink's failure.  A ``SystemExit`` raised
by a submit the destination actor made ended the actor, the routing sink's
run and with it the runtime's loop: the batch in that submit was counted
nowhere (its forward route had accepted it, neither processed nor given it
up), whatever was queued behind it was counted abandoned as at a shutdown,
and the flush raised "runtime loop failed", not naming the destination.
Raised in a submit the record worker made itself (an idle destination whose
submits have been quick), the loop died too and the runtime counted the
whole ingress batch given up on top of the route's ``accepted``.

Nothing is injected: the sink calls ``sys.exit()``.
"""

from __future__ import annotations

import sys

import pytest
import trio

from taproute.actors.destination import is_sink_failure
from taproute.native import make_descriptors
from taproute.routing import Route
from taproute.routing.errors import RoutingFailure
from taproute.service import create_record_runtime
from tests.processors import SCHEMA
from tests.sinks import NullSink
from tests.test_runtime import Q, routing_sink, vec_payload

HANG_GUARD_S = 60.0


class ExitsOnSubmit(NullSink):
    """A sink whose ``exit_on``-th submit (1-based) calls ``sys.exit()``."""

    def __init__(self, exit_on: int) -> None:
        super().__init__()
        self.exit_on = exit_on
        self.calls = 0

    async def submit(self, batch) -> None:
        self.calls += 1
        if self.calls == self.exit_on:
            sys.exit(3)
        await super().submit(batch)


def _adds_up(r) -> bool:
    return r.accepted == r.processed + r.failed + r.dropped + r.given_up + r.parked


@pytest.mark.parametrize(
    "quick_before",
    [
        1,  # the destination actor makes the failing submit
        12,  # after 8 quick submits the deliverer (record worker) may make it itself
    ],
)
def test_a_destination_raising_system_exit_gives_its_records_up_and_the_flush_names_it(
    quick_before,
):
    bad = ExitsOnSubmit(exit_on=quick_before + 1)
    sink = routing_sink(
        {"cap": NullSink(), "bad": bad},
        routes=[Route("raw", Q, "bad"), Route("other", Q, "cap")],
    )
    runtime = create_record_runtime(record_sink=sink)
    q = runtime.bind_hook(Q, layout="vec")

    def submit(n: int) -> None:
        runtime.submit_batch(
            make_descriptors(q, 16, count=n, layout_ids=SCHEMA.layout_id("vec")), vec_payload(n)
        )

    try:
        for _ in range(quick_before):
            submit(2)
            runtime.flush(timeout=HANG_GUARD_S)
        submit(3)  # its submit to "bad" exits
        with pytest.raises(RoutingFailure, match="destination 'bad'") as raised:
            runtime.flush(timeout=HANG_GUARD_S)
        assert isinstance(raised.value.cause, SystemExit)
        assert runtime._thread.is_alive()  # the loop goes on: it was the destination's failure
        counters = runtime.counters()
        raw, other = counters.routes["raw"], counters.routes["other"]
        delivered = 2 * quick_before
        # Before: given_up 0 and the 3 records counted nowhere (or at ingress).
        assert (raw.accepted, raw.processed, raw.given_up) == (delivered + 3, delivered, 3)
        assert _adds_up(raw) and raw.abandoned == 0
        assert (other.accepted, other.processed) == (delivered + 3, delivered + 3)
        destination = counters.destinations["bad"]
        assert (destination.records, destination.failed_records) == (delivered, 3)
        assert destination.errors == 1 and destination.abandoned_records == 0
        assert counters.ingress.given_up == 0 and counters.ingress.submitted == delivered + 3
    finally:
        with pytest.raises(RoutingFailure, match="destination 'bad'"):
            runtime.close(timeout=HANG_GUARD_S)


def _cancelled() -> trio.Cancelled:
    return trio.Cancelled._create()  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("exc", "failure"),
    [
        (SystemExit(3), True),
        (OSError("disk full"), True),
        (BaseExceptionGroup("g", [SystemExit(3), OSError("x")]), True),
        (KeyboardInterrupt(), False),
        (GeneratorExit(), False),
        (_cancelled(), False),
        (BaseExceptionGroup("g", [_cancelled(), OSError("x")]), False),
    ],
)
def test_what_a_sink_raises_is_its_failure_unless_it_stops_the_loop(exc, failure):
    assert is_sink_failure(exc) is failure
