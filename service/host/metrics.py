"""Prometheus exposition of a :class:`~taproute.service.host.counters.ServiceSnapshot`.

A ``prometheus_client`` collector reads one snapshot per scrape; names follow
the conventions Vector and OpenTelemetry users know (``_total`` counters,
units in the name, components as labels).  Which field is a counter and
which a gauge, its name and help, come from the counters classes'
declarations (:func:`~taproute.actors.counters.declared`), not from here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from taproute.actors.counters import (
    DestinationCounters,
    RouteCounters,
    StoreCounters,
    declared,
)
from taproute.service.host.counters import IngressCounters, ReloadCounters, ServiceSnapshot


class SnapshotCollector(Collector):
    """Collects taproute's counters from ``snapshot()`` at scrape time."""

    def __init__(self, snapshot: Callable[[], ServiceSnapshot]) -> None:
        if not callable(snapshot):  # else every scrape fails, far from here
            raise TypeError(
                "SnapshotCollector takes the function that returns the snapshot "
                f"(SnapshotCollector(runtime.counters)), found {type(snapshot).__name__}"
            )
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        yield from _families(IngressCounters, [([], snap.ingress)], [])
        yield from _capture_families(snap.ingress)
        routes = [([r.name, r.mode, r.destination], r) for r in snap.routes.values()]
        route_labels = ["route", "mode", "destination"]
        yield from _families(RouteCounters, routes, route_labels)
        failures = CounterMetricFamily(
            "taproute_route_failures",
            "Failed processing attempts, in records, by failure code.",
            labels=[*route_labels, "code"],
        )
        for values, route in routes:
            for code, n in sorted(route.failures_by_code.items()):
                failures.add_metric([*values, code], n)
        yield failures
        destinations = [([d.name], d) for d in snap.destinations.values()]
        yield from _families(DestinationCounters, destinations, ["destination"])
        stores = [([s.name], s) for s in snap.stores.values()]
        yield from _families(StoreCounters, stores, ["store"])
        unmatched = CounterMetricFamily(
            "taproute_unmatched_records",
            "Records no route took, by what happened to them.",
            labels=["action"],
        )
        unmatched.add_metric(["forwarded"], snap.unmatched_forwarded)
        unmatched.add_metric(["dropped"], snap.unmatched_dropped)
        yield unmatched
        causal = CounterMetricFamily(
            "taproute_causal_records",
            "Derived records (a route's output routed again), by the causal limits' verdict.",
            labels=["verdict"],
        )
        causal.add_metric(["accepted"], snap.causal.derived)
        causal.add_metric(["refused_depth"], snap.causal.refused_depth)
        causal.add_metric(["refused_rate"], snap.causal.refused_rate)
        yield causal
        pinned = GaugeMetricFamily(
            "taproute_causal_pinned_roots", "Roots whose causal limits are pinned now."
        )
        pinned.add_metric([], snap.causal.pinned_roots)
        yield pinned
        evicted = CounterMetricFamily(
            "taproute_causal_roots_evicted",
            "Roots evicted from the full causal ledger (max_roots); their counts restarted.",
        )
        evicted.add_metric([], snap.causal.evicted_roots)
        yield evicted
        failed = GaugeMetricFamily(
            "taproute_failure_latched", "1 once a failure is latched (the router refuses work)."
        )
        failed.add_metric([], 1 if snap.failure else 0)
        yield failed
        generation = GaugeMetricFamily(
            "taproute_config_generation",
            "Number of the configuration generation routing new records (1 until a reload).",
        )
        generation.add_metric([], snap.generation)
        yield generation
        yield from _families(ReloadCounters, [([], snap.reloads)], [])


def _families(
    cls: type, rows: Iterable[tuple[list[str], object]], labels: Sequence[str]
) -> Iterator[Metric]:
    """One family per declared field of ``cls``: counts as counters, live state as
    gauges (counts first); a None value (not applicable) is left out."""
    rows = list(rows)
    for kind in ("count", "live"):
        for field in declared(cls, kind):
            family_type = CounterMetricFamily if kind == "count" else GaugeMetricFamily
            family = family_type(field.metric, field.help, labels=list(labels))
            for values, counters in rows:
                value = getattr(counters, field.field)
                if value is not None:
                    family.add_metric(values, value)
            yield family


def _capture_families(ingress: IngressCounters) -> Iterator[Metric]:
    """What capture hooks dropped (records) and skipped (calls), by hook and reason."""
    for metric, help_text, by_hook in (
        (
            "taproute_capture_dropped_records",
            "Records a capture hook dropped, by hook and reason.",
            ingress.dropped,
        ),
        (
            "taproute_capture_skipped_calls",
            "Capture hook calls that captured nothing, by hook and reason.",
            ingress.skipped,
        ),
    ):
        family = CounterMetricFamily(metric, help_text, labels=["hook", "reason"])
        for hook, reasons in sorted(by_hook.items()):
            for reason, n in sorted(reasons.items()):
                family.add_metric([hook, reason], n)
        yield family
