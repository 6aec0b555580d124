"""Live counters of a routing sink and the snapshot that feeds every exporter.

Counters are plain integers bumped on the Trio loop; :func:`snapshot`-style
methods return detached copies that are safe to hand to other threads.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import attrs


@attrs.define
class RouteCounters:
    """Per route, in records.

    ``queue_depth``: waiting in the route's mailboxes; ``backlog``: accepted
    by the route and not yet done (waiting or being processed); ``processed``:
    input records done; ``emitted``: records (forward) or rows (processed)
    handed to the destination; ``failed``: input records that failed;
    ``valid_slots``: stateful routes' slots holding state (else None);
    ``parked``: records waiting for a retry or behind a failing key;
    ``retries``: retries made; ``recovered``: records processed after failing;
    ``failures_by_code``: failed records per failure code (each attempt counts);
    ``declined``/``last_decline``: records the route's predicate declined, and why.
    """

    name: str
    mode: str
    destination: str
    queue_depth: int = 0
    backlog: int = 0
    processed: int = 0
    emitted: int = 0
    failed: int = 0
    valid_slots: int | None = None
    parked: int = 0
    retries: int = 0
    recovered: int = 0
    declined: int = 0
    last_decline: str | None = None
    failures_by_code: dict[str, int] = attrs.Factory(dict)


@attrs.define
class DestinationCounters:
    """Per destination: records and payload bytes submitted, flushes, errors,
    and what waits in its mailbox."""

    name: str
    records: int = 0
    bytes: int = 0
    batches: int = 0
    flushes: int = 0
    errors: int = 0
    queue_depth: int = 0


@attrs.define
class IngressCounters:
    """Producer side: records and batches accepted, records refused when full,
    seconds producers spent blocked in ``submit``, records queued now and
    producers blocked now."""

    submitted: int = 0
    batches: int = 0
    rejected: int = 0
    blocked_seconds: float = 0.0
    queued: int = 0
    blocked_producers: int = 0


@attrs.frozen
class RouterSnapshot:
    """Everything counted, at one moment.

    ``unmatched_forwarded``/``unmatched_dropped``: records no route took, sent
    to the default destination or dropped (``unmatched="drop"``).  ``failure``
    is the latched failure's message, if any.
    """

    routes: dict[str, RouteCounters]
    destinations: dict[str, DestinationCounters]
    unmatched_forwarded: int
    unmatched_dropped: int
    ingress: IngressCounters | None = None
    failure: str | None = None


@runtime_checkable
class Observable(Protocol):
    """A sink that reports a :class:`RouterSnapshot` (a routing sink does): the
    runtime merges it with its own ingress counters."""

    def snapshot(self) -> RouterSnapshot: ...
