"""A routing sink's submit cut short after routes took part of the batch counts
each record once.

The routing sink hands each route its part of a batch in turn.  When a
later route's ``dispatch`` raised (an unexpected failure), the exception
left the sink's submit and the runtime counted the whole ingress batch
given up (``ingress.given_up``), though the routes before had already
accepted their part: those records were counted twice (accepted by a
route, and given up at ingress).  Now the sink latches the failure and
raises :class:`BatchCutShort`, which says how many records nothing took,
and the runtime counts only those.  A forward route whose own dispatch is
cut short counts what it had not handed to its destination as its
``given_up``, as the other route kinds do.

How the failure is caused: no real input makes a dispatch raise (mailboxes
are open while the sink runs), so the tests inject it: a route's dispatch
is monkeypatched to raise, standing for any internal invariant a future
bug breaks.
"""

from __future__ import annotations

import pytest

from taproute.actors.accounting import flush_report
from taproute.actors.destination import DestinationActor
from taproute.actors.pool import StatelessRoute
from taproute.native import make_descriptors
from taproute.routing import Route
from taproute.routing.errors import RoutingFailure
from taproute.service import RouteAccount, create_record_runtime
from tests.processors import SCHEMA
from tests.sinks import NullSink
from tests.test_runtime import Q, eventually, routing_sink, vec_payload

HANG_GUARD_S = 60.0
K = "layers.0.attn.k"


class InvariantBroken(RuntimeError):
    """What the injected fault raises."""


def _adds_up(r) -> bool:
    return r.accepted == r.processed + r.failed + r.dropped + r.given_up + r.parked


def _wait_idle(runtime) -> None:
    """What the routes took is theirs, settled in its own time (the flush
    raised the latched failure at once): wait until nothing is queued."""

    def idle() -> bool:
        counters = runtime.counters()
        return counters.destinations["cap"].queue_depth == 0 and all(
            r.backlog == 0 for r in counters.routes.values()
        )

    eventually(idle, timeout=HANG_GUARD_S)


def _submit_mixed(runtime, q: int, k: int, n_q: int, n_k: int) -> None:
    """One batch: ``n_q`` records of hook ``q``, then ``n_k`` of hook ``k``."""
    n = n_q + n_k
    runtime.submit_batch(
        make_descriptors([q] * n_q + [k] * n_k, 16, layout_ids=SCHEMA.layout_id("vec")),
        vec_payload(n),
    )


@pytest.mark.parametrize(
    ("raw_outputs", "untaken"),
    [
        ("layers.*", 0),  # "raw" took every record before "norm" failed
        (Q, 5),  # "raw" took the q records; nothing took the 5 k records
    ],
)
def test_a_submit_cut_short_after_a_route_took_its_part_counts_each_record_once(
    monkeypatch, raw_outputs, untaken
):
    armed = False
    real = StatelessRoute.dispatch_here

    async def dispatch_here(self, batch):
        if armed and self.name == "norm":
            raise InvariantBroken("handing the batch to route norm broke an invariant")
        await real(self, batch)

    monkeypatch.setattr(StatelessRoute, "dispatch_here", dispatch_here)
    sink = routing_sink(
        {"cap": NullSink()},
        routes=[
            Route("raw", raw_outputs, "cap"),  # first in route order: takes its part first
            Route("norm", K, "cap", mode="stateless", processor="test.norms"),
        ],
        unmatched="drop",
    )
    runtime = create_record_runtime(record_sink=sink)
    q = runtime.bind_hook(Q, layout="vec")
    k = runtime.bind_hook(K, layout="vec")
    try:
        _submit_mixed(runtime, q, k, 3, 5)
        runtime.flush(timeout=HANG_GUARD_S)
        armed = True
        _submit_mixed(runtime, q, k, 3, 5)
        with pytest.raises(RoutingFailure, match="norm") as raised:
            runtime.flush(timeout=HANG_GUARD_S)
        assert isinstance(raised.value.cause, InvariantBroken)
        _wait_idle(runtime)
        counters = runtime.counters()
        raw, norm = counters.routes["raw"], counters.routes["norm"]
        taken_by_raw = 8 if raw_outputs == "layers.*" else 3
        assert (raw.accepted, raw.processed) == (2 * taken_by_raw, 2 * taken_by_raw)
        assert (norm.accepted, norm.processed) == (5, 5)  # the first batch only
        assert _adds_up(raw) and _adds_up(norm)
        # Before: 8, the whole batch, though "raw" had taken (and delivered) its part.
        assert counters.ingress.given_up == untaken
        assert counters.ingress.submitted == 16
    finally:
        armed = False
        with pytest.raises(RoutingFailure, match="norm"):
            runtime.close(timeout=HANG_GUARD_S)


def test_a_forward_dispatch_cut_short_counts_what_it_did_not_hand_on_as_given_up(monkeypatch):
    """Fan-out: a forward route, then a stateless one.  The forward route's
    hand-off to its destination raises: before, the exception left the
    sink's submit, the forward route's ``accepted`` no longer added up and
    the runtime counted the whole batch given up at ingress though "norm"
    was never reached (and nothing else took the records).  Now "raw"
    counts them given up, latches naming itself, and "norm" still gets them."""
    armed = False
    real = DestinationActor.deliver

    async def deliver(self, route, batch):
        if armed and getattr(route, "name", None) == "raw":
            raise InvariantBroken("handing the batch to destination cap broke an invariant")
        await real(self, route, batch)

    monkeypatch.setattr(DestinationActor, "deliver", deliver)
    sink = routing_sink(
        {"cap": NullSink()},
        routes=[
            Route("raw", Q, "cap"),
            Route("norm", Q, "cap", mode="stateless", processor="test.norms"),
        ],
    )
    runtime = create_record_runtime(record_sink=sink)
    q = runtime.bind_hook(Q, layout="vec")
    try:
        _submit_mixed(runtime, q, q, 4, 0)
        runtime.flush(timeout=HANG_GUARD_S)
        armed = True
        _submit_mixed(runtime, q, q, 4, 0)
        with pytest.raises(RoutingFailure, match="raw") as raised:
            runtime.flush(timeout=HANG_GUARD_S)
        assert isinstance(raised.value.cause, InvariantBroken)
        _wait_idle(runtime)
        counters = runtime.counters()
        raw, norm = counters.routes["raw"], counters.routes["norm"]
        assert (raw.accepted, raw.processed, raw.given_up) == (8, 4, 4) and _adds_up(raw)
        assert (norm.accepted, norm.processed) == (8, 8) and _adds_up(norm)
        assert counters.ingress.given_up == 0 and counters.ingress.submitted == 8
        # The flush report of these counters (what a flush reads them as)
        # shows the give-up per route and adds up; before it had no given_up
        # and "raw" read as unsettled (accepted 8 = delivered 4 + ... 0).
        report = flush_report(counters, parked_durable=False, waited=False)
        assert report.routes["raw"] == RouteAccount(
            accepted=8, delivered=4, dead_lettered=0, dropped=0, parked=0, given_up=4
        )
        assert all(account.settled for account in report.routes.values())
    finally:
        armed = False
        with pytest.raises(RoutingFailure, match="raw"):
            runtime.close(timeout=HANG_GUARD_S)
