"""One observation verb: ``snapshot()`` on runtime, routing sink, routes and
destinations; counts (monotonic) declared apart from live state (now)."""

from __future__ import annotations

import attrs
import numpy as np
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from taproute.actors import DestinationCounters, RouteCounters, RouterSnapshot, RoutingSink
from taproute.actors.counters import declared
from taproute.routing import Route, RoutingConfig
from taproute.service import IngressCounters, ServiceSnapshot, create_record_runtime
from taproute.service.host.metrics import SnapshotCollector
from tests.processors import SCHEMA
from tests.sinks import NullSink


def test_every_counters_class_declares_counts_apart_from_live_state():
    live = {d.field for d in declared(RouteCounters, "live")}
    assert live == {
        "queue_depth",
        "backlog",
        "valid_slots",
        "parked",
        "abandoned_calls",
        "open_keys",
    }
    assert {d.field for d in declared(DestinationCounters, "live")} == {
        "queue_depth",
        "healthy",  # with a spool or a ClickHouse sink; the other three with a spool
        "spool_bytes",
        "spool_segments",
        "spool_oldest_age_seconds",
    }
    assert {d.field for d in declared(IngressCounters, "live")} == {
        "queued",
        "queued_key_controls",
        "queued_sink_controls",
        "queued_reloads",
        "blocked_producers",
    }
    names = [
        d.metric
        for cls in (RouteCounters, DestinationCounters, IngressCounters)
        for d in declared(cls)
    ]
    assert len(names) == len(set(names))  # one metric per field


def sink() -> RoutingSink:
    return RoutingSink(
        RoutingConfig(
            [
                Route("raw", "layers.*", "cap"),
                Route("sums", "layers.*", "cap", mode="stateful", processor="test.running_sum"),
            ]
        ),
        SCHEMA,
        {"cap": NullSink()},
        unmatched="drop",
    )


def test_runtime_and_sink_answer_snapshot_with_live_state_drained_and_counts_kept():
    routing = sink()
    with create_record_runtime(record_sink=routing) as runtime:
        q = runtime.bind_hook("layers.0.q", layout="vec")
        for i in range(12):
            runtime.submit(q, np.full(4, i, np.float32))
        runtime.flush()
        snap = runtime.snapshot()
        assert isinstance(snap, ServiceSnapshot) and runtime.counters() == snap
        inner = routing.snapshot()
        assert type(inner) is RouterSnapshot and inner.routes == snap.routes
    assert snap.ingress.submitted == 12
    for route in snap.routes.values():
        counts = {d.field: getattr(route, d.field) for d in declared(RouteCounters, "count")}
        live = {d.field: getattr(route, d.field) for d in declared(RouteCounters, "live")}
        assert counts["processed"] == 12
        # After a flush nothing waits anywhere; what stays is what was done.
        assert {k: v for k, v in live.items() if k not in ("valid_slots", "open_keys")} == {
            "queue_depth": 0,
            "backlog": 0,
            "parked": 0,
            "abandoned_calls": 0,
        }
    assert snap.routes["sums"].valid_slots == 1  # every record had key 0
    assert snap.routes["raw"].valid_slots is None
    assert snap.routes["sums"].open_keys == 1 and snap.routes["raw"].open_keys is None


def test_metric_types_follow_the_declarations():
    snap = ServiceSnapshot(
        routes={"r": RouteCounters("r", "forward", "d", processed=3, queue_depth=2)},
        destinations={"d": DestinationCounters("d", records=3, queue_depth=1)},
        unmatched_forwarded=0,
        unmatched_dropped=0,
    )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(lambda: snap))
    families = {
        f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())
    }
    for cls, instance in ((RouteCounters, snap.routes["r"]), (IngressCounters, snap.ingress)):
        for d in declared(cls):
            name = d.metric.removesuffix("_total")
            family = families[name]
            assert family.type == ("counter" if d.kind == "count" else "gauge"), d.field
            if getattr(instance, d.field) is not None and family.samples:
                assert family.samples[0].value == getattr(instance, d.field)
    assert attrs.asdict(snap)["ingress"]["submitted"] == 0


def test_every_count_the_readme_lists_is_declared_and_exported():
    """The README lists per destination "records, bytes, batches, flushes,
    errors" among the counts, each "declared either a count (a Prometheus
    counter) or live state"; ``batches`` was a plain field: in snapshot() and
    /status, never on /metrics. Every integer field of a counters class is now
    one or the other (names, reasons and per-code maps are labels or detail)."""
    detail = {"name", "mode", "destination", "last_decline", "failures_by_code"}
    detail |= {"oldest_open_key_age_s", "unhealthy_since", "unhealthy_reason"}  # /status
    detail |= {"cut_short"}  # the call a bounded shutdown cut off: /status
    detail |= {"dropped", "skipped"}  # by hook and reason: taproute_capture_* families
    for cls in (RouteCounters, DestinationCounters, IngressCounters):
        plain = {f.name for f in attrs.fields(cls) if "kind" not in f.metadata}
        assert plain <= detail, (cls.__name__, plain - detail)
    snap = ServiceSnapshot(
        routes={},
        destinations={"d": DestinationCounters("d", records=6, batches=2)},
        unmatched_forwarded=0,
        unmatched_dropped=0,
    )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(lambda: snap))
    text = generate_latest(registry).decode()
    assert 'taproute_destination_sent_batches_total{destination="d"} 2.0' in text
