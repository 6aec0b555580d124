"""A route whose ``dispatch`` fails after accepting counts each record once.

A stateful route's ``dispatch`` counts the batch accepted, then hands each
owner its part.  When handing a part on raised (an unexpected failure), the
exception left the routing sink's submit and the runtime counted the whole
ingress batch given up (``ingress.given_up``) as well: the route had
accepted records it never settled (its ``accepted`` no longer added up) and
the runtime counted them, and the records other routes had already taken,
a second time.  Now the route counts what it had not handed on as its own
``given_up`` and latches the failure naming itself; the batch counts as
handed on, so the runtime counts none of it again.

How the failure is caused: no real input makes handing a part to an owner
raise (the owner mailboxes are open while the route runs), so the test
injects it: ``StatefulRoute._enqueue`` is monkeypatched to raise for the
second owner part of one batch, standing for any internal invariant a
future bug breaks.
"""

from __future__ import annotations

import pytest

from taproute.actors.owners import StatefulRoute
from taproute.native import make_descriptors
from taproute.routing import Route
from taproute.routing.errors import RoutingFailure
from taproute.service import create_record_runtime
from tests.sinks import NullSink
from tests.test_runtime import Q, eventually, routing_sink, vec_payload

HANG_GUARD_S = 60.0


class InvariantBroken(RuntimeError):
    """What the injected fault raises."""


def _adds_up(r) -> bool:
    return r.accepted == r.processed + r.failed + r.dropped + r.given_up + r.parked


def test_a_stateful_dispatch_cut_short_counts_its_unhanded_records_once(monkeypatch):
    armed = False
    handed: list[int] = []
    refused: list[int] = []
    real = StatefulRoute._enqueue

    async def enqueue(self, mailbox, message, batch, *, wait=True):
        if armed and handed:  # the second owner part of the armed batch
            refused.append(len(batch))
            raise InvariantBroken("handing a part to its owner broke an invariant")
        if armed:
            handed.append(len(batch))
        await real(self, mailbox, message, batch, wait=wait)

    monkeypatch.setattr(StatefulRoute, "_enqueue", enqueue)
    sink = routing_sink(
        {"cap": NullSink()},
        routes=[
            Route("sum", Q, "cap", mode="stateful", processor="test.running_sum", workers=2),
            Route("raw", Q, "cap"),  # fan-out: the same records, a forward route
        ],
    )
    runtime = create_record_runtime(record_sink=sink)
    q = runtime.bind_hook(Q, layout="vec")

    def submit() -> None:
        keys = [0, 8, 1, 9, 2, 10, 3, 11]  # of 16 keys: both owners get a part
        runtime.submit_batch(
            make_descriptors(q, 16, count=8, keys=keys, layout_ids=0), vec_payload(8)
        )

    try:
        submit()
        runtime.flush(timeout=HANG_GUARD_S)
        armed = True
        submit()
        with pytest.raises(RoutingFailure, match="sum") as raised:
            runtime.flush(timeout=HANG_GUARD_S)
        assert isinstance(raised.value.cause, InvariantBroken)
        assert len(handed) == 1 and len(refused) == 1  # one part handed on, one cut short
        # The part handed on is its owner's: settled there, in its own time.
        eventually(lambda: runtime.counters().routes["sum"].backlog == 0, timeout=HANG_GUARD_S)
        counters = runtime.counters()
        route, raw = counters.routes["sum"], counters.routes["raw"]
        # Before: given_up 0 (accepted 16 did not add up) and ingress.given_up 8
        # counted the same records again, and "raw" never got the second batch.
        assert (route.accepted, route.given_up) == (16, refused[0])
        assert route.processed == 16 - refused[0] and _adds_up(route)
        assert counters.ingress.given_up == 0 and counters.ingress.submitted == 16
        assert (raw.accepted, raw.processed) == (16, 16)
    finally:
        armed = False
        with pytest.raises(RoutingFailure, match="sum"):
            runtime.close(timeout=HANG_GUARD_S)
