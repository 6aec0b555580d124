"""A routing sink's counters read as a :class:`~taproute.routing.flush_report.FlushReport`."""

from __future__ import annotations

from taproute.actors.counters import RouterSnapshot
from taproute.routing.flush_report import FlushReport, RouteAccount


def flush_report(snapshot: RouterSnapshot, *, parked_durable: bool, waited: bool) -> FlushReport:
    """Where every accepted record stands, from a snapshot taken after a flush."""
    return FlushReport(
        routes={
            name: RouteAccount(
                accepted=route.accepted,
                delivered=route.processed,
                dead_lettered=route.failed,
                dropped=route.dropped,
                parked=route.parked,
                restored=route.restored,
                given_up=route.given_up,
            )
            for name, route in snapshot.routes.items()
        },
        parked_durable=parked_durable,
        spooled_bytes={
            name: destination.spool_bytes
            for name, destination in snapshot.destinations.items()
            if destination.spool_bytes is not None
        },
        unmatched_forwarded=snapshot.unmatched_forwarded,
        unmatched_dropped=snapshot.unmatched_dropped,
        waited=waited,
        shed_records={
            name: destination.spool_shed_records
            for name, destination in snapshot.destinations.items()
            if destination.spool_shed_records is not None
        },
        refused_records={
            name: destination.refused_records
            for name, destination in snapshot.destinations.items()
            if destination.refused_records is not None
        },
    )
