"""What a routing sink counts, and the snapshot that feeds every exporter.

Each field declares what it is: a *count* (monotonic since start: exported
as a Prometheus counter) or *live* state (what is queued or held now: a
gauge), with its metric name and help text.  Exporters read these
declarations (:func:`declared`); nothing else lists the fields again.

Counters are plain integers bumped on the Trio loop; every ``snapshot()``
returns a detached copy that is safe to hand to other threads.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal, Protocol, runtime_checkable

import attrs

from taproute.routing.causal import CausalSnapshot
from taproute.routing.refusals import UnmatchedSample

Kind = Literal["count", "live"]


def count(metric: str, help: str) -> Any:
    """A monotonic count (starts at 0), exported as counter ``metric``."""
    return attrs.field(default=0, metadata={"kind": "count", "metric": metric, "help": help})


def live(metric: str, help: str, default: int | None = 0) -> Any:
    """Live state (what is there now), exported as gauge ``metric``."""
    return attrs.field(default=default, metadata={"kind": "live", "metric": metric, "help": help})


@attrs.frozen
class Declared:
    """One declared field: its name, kind, metric name and help text."""

    field: str
    kind: Kind
    metric: str
    help: str


def declared(cls: type, kind: Kind | None = None) -> Iterator[Declared]:
    """The declared fields of counters class ``cls`` (of one ``kind``), in order."""
    for field in attrs.fields(cls):
        meta = field.metadata
        if "kind" in meta and (kind is None or meta["kind"] == kind):
            yield Declared(field.name, meta["kind"], meta["metric"], meta["help"])


@attrs.define
class RouteCounters:
    """Per route, in records.

    Counts: ``accepted`` records the route took (a restart's ``restored``
    parked records included); ``processed`` input records done; ``emitted``
    records (forward) or rows (processed) handed to the destination; ``failed``
    input records given up; ``dropped`` discarded and counted (by a cancel,
    or terminal under the ``drop`` policy); ``given_up`` left unfinished by
    an unexpected internal failure of the route, or (a forward route) in a
    submit its destination's sink raised on (latched: the runtime has
    failed), neither processed nor dead-lettered; so once nothing is queued,
    ``accepted = processed + failed + dropped + given_up + parked``.  ``retries`` made;
    ``recovered`` records processed after failing;
    ``declined`` by the route's predicate (``last_decline``: why, last time);
    ``derived``: records of its output that chained routes took again;
    ``failures_by_code``: failed records per failure code (each attempt counts);
    ``abandoned``: records queued in its mailboxes when the sink stopped without
    draining them (a shutdown whose grace ran out), given up.

    Live: ``queue_depth`` waiting in the route's mailboxes; ``backlog``
    accepted and not yet done (waiting or being processed); ``parked``
    waiting for a retry or behind a failing key; ``abandoned_calls``
    processor calls given up at their deadline whose thread still runs (each
    holds its batch's buffer until it returns); ``valid_slots`` stateful
    routes' slots holding state (else None).

    Key lifecycle (stateful routes): ``completed_keys``/``cancelled_keys``
    ended; ``cancelled_records`` discarded by a cancel; ``terminal_records``
    arrived for an ended key; ``finalize_rows`` emitted at completion;
    live ``open_keys`` and ``oldest_open_key_age_s`` (a leaked key shows as
    an ever-growing age).
    """

    name: str
    mode: str
    destination: str
    queue_depth: int = live("taproute_route_queue_depth_records", "Records waiting in mailboxes.")
    backlog: int = live("taproute_route_backlog_records", "Records accepted and not done.")
    accepted: int = count(
        "taproute_route_accepted_records", "Records a route took (restored ones included)."
    )
    dropped: int = count(
        "taproute_route_dropped_records",
        "Records a route dropped and counted (cancelled, terminal with the drop policy).",
    )
    restored: int = count(
        "taproute_route_restored_records", "Parked records a previous run left, taken back."
    )
    processed: int = count("taproute_route_processed_records", "Input records a route processed.")
    emitted: int = count("taproute_route_emitted_records", "Records or rows a route sent on.")
    failed: int = count(
        "taproute_route_failed_records", "Input records a route gave up on (dead-lettered)."
    )
    given_up: int = count(
        "taproute_route_given_up_records",
        "Input records an unexpected internal failure of the route, or of its "
        "destination's submit (forward routes), left unfinished (latched): neither "
        "processed nor dead-lettered.",
    )
    valid_slots: int | None = live(
        "taproute_route_valid_slots", "State slots holding state (stateful routes).", None
    )
    parked: int = live(
        "taproute_route_parked_records", "Records waiting for a retry or behind a failing key."
    )
    abandoned_calls: int = live(
        "taproute_route_abandoned_calls",
        "Processor calls past their deadline still running (each holds its batch's buffer).",
    )
    abandoned: int = count(
        "taproute_route_abandoned_records",
        "Records queued in a route's mailboxes given up when the sink stopped without "
        "draining (a shutdown whose grace ran out).",
    )
    retries: int = count("taproute_route_retries", "Retries of parked records.")
    recovered: int = count("taproute_route_recovered_records", "Records processed after failing.")
    declined: int = count(
        "taproute_route_declined_records", "Records the route's predicate declined."
    )
    derived: int = count(
        "taproute_route_derived_records",
        "Records of this route's output routed again (accepted by the causal limits).",
    )
    completed_keys: int = count(
        "taproute_route_completed_keys", "Keys completed (finalized, slot cleared)."
    )
    cancelled_keys: int = count("taproute_route_cancelled_keys", "Keys cancelled (slot cleared).")
    cancelled_records: int = count(
        "taproute_route_cancelled_records", "Queued records of cancelled keys, discarded."
    )
    terminal_records: int = count(
        "taproute_route_terminal_records", "Records for completed or cancelled keys, not applied."
    )
    finalize_rows: int = count("taproute_route_finalize_rows", "Rows emitted by finalize.")
    finalize_failures: int = count(
        "taproute_route_finalize_failures", "Finalize calls that raised (slot cleared anyway)."
    )
    open_keys: int | None = live(
        "taproute_route_open_keys", "Keys open on a stateful route (first record, not ended).", None
    )
    #: Seconds, read at the snapshot: left out of equality (it moves with the clock).
    oldest_open_key_age_s: float | None = attrs.field(default=None, eq=False)
    last_decline: str | None = None
    failures_by_code: dict[str, int] = attrs.Factory(dict)


@attrs.define
class DestinationCounters:
    """Per destination.  Counts: records and payload bytes submitted, batches,
    flushes, errors; ``abandoned_records``/``abandoned_batches`` given up at a
    shutdown whose grace ran out (queued for the sink, or in a submit it had
    not returned from: never delivered); ``given_up_records``, records the
    sink took (counted sent) and then gave up itself: a ClickHouse sink's
    buffered or in-flight rows when a cut cancelled it, or rows a close
    stopped waiting for (its ``abandoned_rows``); ``failed_records``, records
    (or a processor's rows) in submits the sink raised on (any exception but
    cancellation, ``SystemExit`` included; the failure is latched, naming the
    destination): never taken, never delivered, not counted sent.  Every count
    only grows (records given up stay counted as sent: they were handed over).
    Live: ``queue_depth``, records waiting in its mailbox.  ``cut_short``:
    the call shutdown found still running and cut off (``"submit"``, ``"flush"``, ``"close"``, or
    ``"queued"`` for batches waiting behind one), else None."""

    name: str
    records: int = count("taproute_destination_sent_records", "Records handed to the sink.")
    bytes: int = count("taproute_destination_sent_bytes", "Payload bytes handed to the sink.")
    batches: int = count("taproute_destination_sent_batches", "Batches handed to the sink.")
    flushes: int = count("taproute_destination_flushes", "Flushes of the sink.")
    errors: int = count("taproute_destination_errors", "Sink calls that raised.")
    abandoned_records: int = count(
        "taproute_destination_abandoned_records",
        "Records given up at a shutdown whose grace ran out (queued for the sink or in "
        "a submit it had not returned from).",
    )
    abandoned_batches: int = count(
        "taproute_destination_abandoned_batches",
        "Batches given up at a shutdown whose grace ran out.",
    )
    given_up_records: int = count(
        "taproute_destination_given_up_records",
        "Records the sink took and then gave up, not delivered (a shutdown's cut, a "
        "close that stopped waiting).",
    )
    failed_records: int = count(
        "taproute_destination_failed_records",
        "Records (or rows) in submits the sink raised on (a failure, latched): never "
        "taken, never delivered.",
    )
    queue_depth: int = live(
        "taproute_destination_queue_depth_records", "Records waiting for the sink."
    )
    cut_short: str | None = None
    #: With a spool, or a sink that reports it (``ReportsReach``: a ClickHouse
    #: sink), None without: True while the destination takes batches, False
    #: while it is unreachable and batches spool, or the sink retries
    #: (``/status`` says true/false, ``/metrics`` 1/0); since when and why.
    healthy: bool | None = live(
        "taproute_destination_healthy",
        "1 while the destination takes batches, 0 while it is unreachable "
        "(batches spool, or the sink retries).",
        None,
    )
    unhealthy_since: float | None = None
    unhealthy_reason: str | None = None
    spool_bytes: int | None = live(
        "taproute_destination_spool_bytes", "Unacknowledged bytes in the spool.", None
    )
    spool_segments: int | None = live(
        "taproute_destination_spool_segments", "Segment files of the spool.", None
    )
    spool_oldest_age_seconds: float | None = live(
        "taproute_destination_spool_oldest_unacked_age_seconds",
        "Age of the oldest batch in the spool.",
        None,
    )
    spool_drained_records: int | None = attrs.field(
        default=None,
        metadata={
            "kind": "count",
            "metric": "taproute_destination_spool_drained_records",
            "help": "Records delivered from the spool (its rate is the drain rate).",
        },
    )
    spool_shed_records: int | None = attrs.field(
        default=None,
        metadata={
            "kind": "count",
            "metric": "taproute_destination_spool_shed_records",
            "help": "Records a full spool shed by its when_full policy (dropped, "
            "dead-lettered, or a block that ran out of time).",
        },
    )
    refused_records: int | None = attrs.field(
        default=None,
        metadata={
            "kind": "count",
            "metric": "taproute_destination_refused_records",
            "help": "Records the destination refused (bad data): dead-lettered.",
        },
    )
    #: Of a sink that retries its writes itself (None for others): its insert
    #: attempts that failed, retried or not; it grows while the sink retries.
    insert_errors: int | None = attrs.field(
        default=None,
        metadata={
            "kind": "count",
            "metric": "taproute_destination_insert_errors",
            "help": "Insert attempts of the destination's sink that failed, retried or not "
            "(a writer process's death counts as one).",
        },
    )


@attrs.define
class StoreCounters:
    """A durable store the routes write given-up (and parked) records to: the
    dead-letter SQLite file, named by its path.

    Live: ``available`` (False while another holder keeps it locked: writes
    wait and retry; ``unavailable_since``, wall seconds, and
    ``unavailable_reason`` say since when and why), ``waiting_writes`` and
    ``waiting_records`` (writes waiting for it now, each holding its records
    in its route).  Counts: ``locked_attempts``, write attempts that found it
    locked (each waited the store's busy timeout, then was retried), and
    ``locked_writes``, writes that had to wait (done, or still waiting)."""

    name: str
    available: bool = live(
        "taproute_store_available",
        "1 while the store takes writes, 0 while it is locked by another holder "
        "(writes wait and retry).",
        True,
    )
    waiting_writes: int = live(
        "taproute_store_waiting_writes", "Writes waiting for a locked store now."
    )
    waiting_records: int = live(
        "taproute_store_waiting_records",
        "Records in writes waiting for a locked store now (held by their routes).",
    )
    locked_attempts: int = count(
        "taproute_store_locked_attempts",
        "Write attempts that found the store locked (retried with backoff).",
    )
    locked_writes: int = count(
        "taproute_store_locked_writes", "Writes that found the store locked and had to wait."
    )
    unavailable_since: float | None = None
    unavailable_reason: str | None = None


@runtime_checkable
class ReportsStore(Protocol):
    """A failure handler's owner or park store that reports its store
    (:class:`StoreCounters`): the routing sink adds it to its snapshot."""

    def store_status(self) -> StoreCounters: ...


@attrs.frozen(kw_only=True)
class RouterSnapshot:
    """Everything a routing sink counted, at one moment.

    ``unmatched_forwarded``/``unmatched_dropped``: records no route took, sent
    to the default destination or dropped (``unmatched="drop"``), and
    ``unmatched_samples`` a few recent ones per hook with the routes that
    declined them.  ``causal``: derived records accepted and refused by the
    causal limits.  ``failure`` is the latched failure's message, if any.
    ``stores``: the durable stores give-ups are written to (the dead-letter
    file), by path, with whether they take writes now.
    ``generation`` is the number of the configuration generation routing new
    records (1 until a reload; 0 for a sink that has no generations).
    """

    routes: dict[str, RouteCounters]
    destinations: dict[str, DestinationCounters]
    unmatched_forwarded: int
    unmatched_dropped: int
    failure: str | None = None
    #: What the causal limits did to derived records (chains).
    causal: CausalSnapshot = attrs.Factory(CausalSnapshot)
    #: Per hook, recent records no route took, with each route's refusal.
    unmatched_samples: dict[str, list[UnmatchedSample]] = attrs.Factory(dict)
    generation: int = 0
    #: The stores given-up and parked records are written to, by name (path).
    stores: dict[str, StoreCounters] = attrs.Factory(dict)


@runtime_checkable
class Observable(Protocol):
    """A sink that reports a :class:`RouterSnapshot` (a routing sink does): the
    runtime merges it with its own ingress counters."""

    def snapshot(self) -> RouterSnapshot: ...
