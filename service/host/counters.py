"""What the service counts on top of its record sink: the ingress, and the
snapshot that joins both.

The ingress belongs to the runtime (producer threads, not the routing sink),
so its counters live here; fields declare count or live state as the routing
sink's do (:mod:`taproute.actors.counters`).
"""

from __future__ import annotations

from typing import Literal

import attrs

from taproute.actors.counters import RouterSnapshot, count, live


@attrs.define
class IngressCounters:
    """Producer side.  Counts: records and batches accepted, records refused
    when full, seconds producers spent blocked in ``submit``, records shed
    past ``max_block``, batches merged with others of their wake-up into
    one dispatch; records given up at a shutdown whose grace ran out before
    the record worker handed them on (``abandoned``); records ``submit()``
    accepted and never routed because the runtime had failed (``given_up``:
    queued when the first failure was latched, in the batch the record
    sink's submit refused (of a batch a routing sink took in part before it
    failed, those no route took), or left when the loop died); key controls refused
    because no stateful route holds a key (``refused_key_controls``: the
    caller's future raised :class:`KeyNotHeld`, or nobody looked, as
    ``capture_context(end_keys=...)`` does not); key controls the runtime
    could not take any more (``failed_key_controls``: closed, failed, its
    loop gone, or not started); key controls refused because ingress was
    full (``rejected_key_controls``, ``when_full="reject"``) or shed at the
    end of a capture block past ``max_block`` (``shed_key_controls``): their
    keys stay open; ``flush()`` calls that shared the flush queued last
    instead of queueing another (``coalesced_flushes``); what capture hooks
    dropped or skipped, by hook and reason.  Live: records, key controls
    and flush/reload controls (``queued_sink_controls``) queued now,
    reloads queued and not yet swapped in (``queued_reloads``), producers
    blocked now (a flush, reload or key control waiting for room counts as
    one)."""

    submitted: int = count("taproute_ingress_submitted_records", "Records producers submitted.")
    batches: int = count("taproute_ingress_submitted_batches", "Batches crossing into the router.")
    rejected: int = count(
        "taproute_ingress_rejected_records", "Records refused because ingress was full."
    )
    blocked_seconds: float = count(
        "taproute_ingress_blocked_seconds", "Seconds producers spent blocked in submit."
    )
    queued: int = live("taproute_ingress_queued_records", "Records accepted and not yet routed.")
    blocked_producers: int = live(
        "taproute_ingress_blocked_producers", "Producers blocked in submit now."
    )
    shed: int = count(
        "taproute_ingress_shed_records", "Records shed when a producer's max_block ran out."
    )
    merged: int = count(
        "taproute_ingress_merged_batches",
        "Batches handed on merged with others of the same wake-up (one dispatch for several).",
    )
    abandoned: int = count(
        "taproute_ingress_abandoned_records",
        "Records still in ingress when a shutdown's grace ran out, given up.",
    )
    given_up: int = count(
        "taproute_ingress_given_up_records",
        "Records accepted by submit and never routed because the runtime had failed "
        "(queued when its first failure was latched, or refused by the record sink).",
    )
    refused_key_controls: int = count(
        "taproute_ingress_refused_key_controls",
        "Key controls (complete, cancel, reopen) refused with KeyNotHeld: a key no "
        "stateful route holds.",
    )
    failed_key_controls: int = count(
        "taproute_ingress_failed_key_controls",
        "Key controls (complete, cancel, reopen) refused because the runtime was closed, "
        "failed, its loop gone, or not started.",
    )
    rejected_key_controls: int = count(
        "taproute_ingress_rejected_key_controls",
        "Key controls (complete, cancel, reopen) refused because ingress was full "
        "(when_full='reject'): their keys stay open.",
    )
    shed_key_controls: int = count(
        "taproute_ingress_shed_key_controls",
        "Key controls ending a capture_context block shed when ingress stayed full past "
        "max_block: their keys stay open.",
    )
    queued_key_controls: int = live(
        "taproute_ingress_queued_key_controls",
        "Key controls accepted and not yet run (each takes one record's ingress room).",
    )
    coalesced_flushes: int = count(
        "taproute_ingress_coalesced_flushes",
        "flush() calls that shared the flush control queued last (nothing queued after "
        "it) instead of queueing one more.",
    )
    queued_sink_controls: int = live(
        "taproute_ingress_queued_sink_controls",
        "Flush and reload controls accepted and not yet run (each takes one record's "
        "ingress room).",
    )
    queued_reloads: int = live(
        "taproute_ingress_queued_reloads",
        "Reloads checked and queued behind the records submitted before them, not yet swapped in.",
    )
    #: Records capture hooks dropped before submitting them: hook -> reason -> records.
    dropped: dict[str, dict[str, int]] = attrs.Factory(dict)
    #: Capture hook calls that captured nothing: hook -> reason -> calls.
    skipped: dict[str, dict[str, int]] = attrs.Factory(dict)


#: What came of a reload: ``pending`` (checked, queued, not swapped in yet),
#: ``applied`` (its generation routes), ``refused`` (at its check, or at its
#: swap: the running generation went on), ``not_queued`` (ingress stayed full
#: for its whole wait: nothing changed).
ReloadOutcome = Literal["pending", "applied", "refused", "not_queued"]


@attrs.frozen(kw_only=True)
class ReloadStatus:
    """One reload asked of the runtime and what came of it.

    ``id`` numbers the runtime's reloads in the order they were asked (1
    first; ``POST /reload`` answers it as ``reload_id``).  What was asked:
    ``source``, the config file (None: a ``RoutingConfig`` given from
    Python), ``config_sha256``, the SHA-256 of the file's bytes as read for
    this reload (``sha256sum`` of the file; None from Python), ``routes``,
    the names of its routes (empty when the file could not be read), and
    ``running_generation``, the generation routing when it was asked.
    ``outcome`` (see :data:`ReloadOutcome`); ``generation``, the number it
    routes as once ``applied``; ``error`` (the whole message) and
    ``problems`` (one line each, at its key path: the destination that failed
    to open, the unknown processor) once ``refused`` or ``not_queued``.
    ``requested_at``/``settled_at``: wall-clock seconds (Unix time);
    ``settled_at`` is None while pending."""

    id: int
    source: str | None
    config_sha256: str | None
    routes: tuple[str, ...]
    running_generation: int
    outcome: ReloadOutcome
    generation: int | None = None
    error: str | None = None
    problems: tuple[str, ...] = ()
    requested_at: float
    settled_at: float | None = None


@attrs.define
class ReloadCounters:
    """Configuration reloads asked of the runtime.  Counts: reloads
    ``applied``, ``refused`` (at their check or at their swap, also when the
    swap came after the caller stopped waiting) and ``not_queued``.  Live:
    ``last_successful``, whether the reload settled last was applied.
    ``recent``: the last reloads asked, oldest first (newest: the snapshot's
    ``last_reload``)."""

    applied: int = count(
        "taproute_config_reloads_applied",
        "Configuration reloads whose generation was swapped in.",
    )
    refused: int = count(
        "taproute_config_reloads_refused",
        "Configuration reloads refused, at their check (the configuration's problems) or "
        "at their swap (a destination that failed to open, the runtime closed or failed), "
        "also after the caller stopped waiting; the running generation went on.",
    )
    not_queued: int = count(
        "taproute_config_reloads_not_queued",
        "Configuration reloads never queued: ingress stayed full for their whole wait.",
    )
    #: False while the reload settled last (applied, refused or not queued,
    #: whichever came last) was not applied; True before any settled.
    last_successful: bool = live(
        "taproute_config_last_reload_successful",
        "0 while the configuration reload settled last was refused or never queued (why: "
        "last_reload in /status), else 1.",
        True,
    )
    recent: list[ReloadStatus] = attrs.Factory(list)


@attrs.frozen
class ServiceSnapshot(RouterSnapshot):
    """The record sink's snapshot (empty routes/destinations for a plain sink)
    plus the runtime's ``ingress`` and ``reloads``; ``failure`` is the first
    failure latched by the runtime or the sink."""

    ingress: IngressCounters = attrs.Factory(IngressCounters)
    reloads: ReloadCounters = attrs.Factory(ReloadCounters)

    @property
    def last_reload(self) -> ReloadStatus | None:
        """The reload asked last and what came of it (None: none asked)."""
        return self.reloads.recent[-1] if self.reloads.recent else None


__all__ = [
    "IngressCounters",
    "ReloadCounters",
    "ReloadOutcome",
    "ReloadStatus",
    "ServiceSnapshot",
]
