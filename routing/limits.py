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

#: Single-record submits coalesced into one batch at most.
COALESCE_RECORDS = 4096


def capped_backoff(initial: float, multiplier: float, maximum: float, failures: int) -> float:
    """Seconds to wait after the ``failures``-th failure (1-based): exponential
    from ``initial`` by ``multiplier``, never more than ``maximum``."""
    return min(maximum, initial * multiplier ** (failures - 1))
