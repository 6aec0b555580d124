"""Default bounds, one home each.

Every queue in taproute is bounded in records and in bytes (one message is a
whole batch).  These are the defaults; each is overridable where it applies.
"""

from __future__ import annotations

#: Records / bytes queued at the runtime's ingress, and in each mailbox of a
#: processing route, before the producer (or the record worker) waits.
QUEUE_RECORDS = 65_536
QUEUE_BYTES = 256 * 2**20

#: Records / bytes queued in each destination's mailbox.
DESTINATION_QUEUE_RECORDS = 262_144
DESTINATION_QUEUE_BYTES = 512 * 2**20

#: Bytes a ClickHouse destination holds buffered or in flight before its
#: ``submit`` waits (``Batching.max_buffered_bytes``).
DESTINATION_BUFFER_BYTES = 256 * 2**20

#: Single-record submits coalesced into one batch at most.
COALESCE_RECORDS = 4096

#: Seconds a runtime's ``close()`` may take to drain, flush and close before
#: what still runs is cut off (Kubernetes' default termination grace).
SHUTDOWN_GRACE_S = 30.0

#: Seconds a sink that is not closed normally (a close cancelled while it
#: waits, a run cut or ended without a close) waits to let go of what it
#: holds (its transport, a spool's files and lock), shielded from the
#: cancellation: past it, the release goes on in its worker thread, or is
#: left behind, and the caller moves on.
RELEASE_WITHIN_S = 10.0


def capped_backoff(initial: float, multiplier: float, maximum: float, failures: int) -> float:
    """Seconds to wait after the ``failures``-th failure (1-based): exponential
    from ``initial`` by ``multiplier``, never more than ``maximum``.

    Defined for any number of failures: past the cap the power is never taken
    (``multiplier ** failures`` overflows a float after about a thousand).
    """
    try:
        return min(maximum, initial * multiplier ** max(failures - 1, 0))
    except OverflowError:  # a float power past ~1e308: far beyond any cap
        return maximum
