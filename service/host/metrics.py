"""Prometheus exposition of a :class:`~taproute.actors.counters.RouterSnapshot`.

A ``prometheus_client`` collector reads one snapshot per scrape; names follow
the conventions Vector and OpenTelemetry users know (``_total`` counters,
units in the name, components as labels).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from taproute.actors.counters import RouterSnapshot


class SnapshotCollector(Collector):
    """Collects taproute's counters from ``snapshot()`` at scrape time."""

    def __init__(self, snapshot: Callable[[], RouterSnapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        yield from _ingress(snap)
        yield from _routes(snap)
        yield from _destinations(snap)
        unmatched = CounterMetricFamily(
            "taproute_unmatched_records",
            "Records no route took, by what happened to them.",
            labels=["action"],
        )
        unmatched.add_metric(["forwarded"], snap.unmatched_forwarded)
        unmatched.add_metric(["dropped"], snap.unmatched_dropped)
        yield unmatched
        failed = GaugeMetricFamily(
            "taproute_failure_latched", "1 once a failure is latched (the router refuses work)."
        )
        failed.add_metric([], 1 if snap.failure else 0)
        yield failed


def _ingress(snap: RouterSnapshot) -> Iterator[Metric]:
    ingress = snap.ingress
    if ingress is None:
        return
    for name, doc, value in (
        ("submitted_records", "Records producers submitted.", ingress.submitted),
        ("submitted_batches", "Batches crossing into the router.", ingress.batches),
        ("rejected_records", "Records refused because ingress was full.", ingress.rejected),
        ("blocked_seconds", "Seconds producers spent blocked in submit.", ingress.blocked_seconds),
    ):
        counter = CounterMetricFamily(f"taproute_ingress_{name}", doc)
        counter.add_metric([], value)
        yield counter
    for name, doc, value in (
        ("queued_records", "Records accepted and not yet routed.", ingress.queued),
        ("blocked_producers", "Producers blocked in submit now.", ingress.blocked_producers),
    ):
        gauge = GaugeMetricFamily(f"taproute_ingress_{name}", doc)
        gauge.add_metric([], value)
        yield gauge


def _routes(snap: RouterSnapshot) -> Iterator[Metric]:
    labels = ["route", "mode", "destination"]
    counters = {
        "processed": CounterMetricFamily(
            "taproute_route_processed_records", "Input records a route processed.", labels=labels
        ),
        "emitted": CounterMetricFamily(
            "taproute_route_emitted_records", "Records or rows a route sent on.", labels=labels
        ),
        "failed": CounterMetricFamily(
            "taproute_route_failed_records",
            "Input records a route gave up on (dead-lettered).",
            labels=labels,
        ),
        "retries": CounterMetricFamily(
            "taproute_route_retries", "Retries of parked records.", labels=labels
        ),
        "recovered": CounterMetricFamily(
            "taproute_route_recovered_records", "Records processed after failing.", labels=labels
        ),
        "declined": CounterMetricFamily(
            "taproute_route_declined_records",
            "Records the route's predicate declined.",
            labels=labels,
        ),
    }
    gauges = {
        "queue_depth": GaugeMetricFamily(
            "taproute_route_queue_depth_records", "Records waiting in mailboxes.", labels=labels
        ),
        "backlog": GaugeMetricFamily(
            "taproute_route_backlog_records", "Records accepted and not done.", labels=labels
        ),
        "parked": GaugeMetricFamily(
            "taproute_route_parked_records",
            "Records waiting for a retry or behind a failing key.",
            labels=labels,
        ),
    }
    failures = CounterMetricFamily(
        "taproute_route_failures",
        "Failed processing attempts, in records, by failure code.",
        labels=[*labels, "code"],
    )
    slots = GaugeMetricFamily(
        "taproute_route_valid_slots", "State slots holding state (stateful routes).", labels=labels
    )
    for route in snap.routes.values():
        values = [route.name, route.mode, route.destination]
        for field, metric in counters.items():
            metric.add_metric(values, getattr(route, field))
        for field, gauge in gauges.items():
            gauge.add_metric(values, getattr(route, field))
        if route.valid_slots is not None:
            slots.add_metric(values, route.valid_slots)
        for code, count in sorted(route.failures_by_code.items()):
            failures.add_metric([*values, code], count)
    yield from counters.values()
    yield from gauges.values()
    yield slots
    yield failures


def _destinations(snap: RouterSnapshot) -> Iterator[Metric]:
    labels = ["destination"]
    families = {
        "records": CounterMetricFamily(
            "taproute_destination_sent_records", "Records handed to the sink.", labels=labels
        ),
        "bytes": CounterMetricFamily(
            "taproute_destination_sent_bytes", "Payload bytes handed to the sink.", labels=labels
        ),
        "flushes": CounterMetricFamily(
            "taproute_destination_flushes", "Flushes of the sink.", labels=labels
        ),
        "errors": CounterMetricFamily(
            "taproute_destination_errors", "Sink calls that raised.", labels=labels
        ),
    }
    depth = GaugeMetricFamily(
        "taproute_destination_queue_depth_records", "Records waiting for the sink.", labels=labels
    )
    for dest in snap.destinations.values():
        for field, metric in families.items():
            metric.add_metric([dest.name], getattr(dest, field))
        depth.add_metric([dest.name], dest.queue_depth)
    yield from families.values()
    yield depth
