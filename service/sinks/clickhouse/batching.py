"""When and how a ClickHouseSink inserts: :class:`Batching` (when a table's
buffer becomes an insert, how many run at once, how much may wait) and
:class:`Retry` (the backoff for transient insert errors)."""

from __future__ import annotations

import attrs

from taproute.routing.checks import Limit, Validator
from taproute.routing.limits import DESTINATION_BUFFER_BYTES, capped_backoff

_DAY = 86_400.0

#: Bounds of :class:`Batching`'s and :class:`Retry`'s numbers: their own
#: validators and config files use these.  A linger of NaN or 0 would spin the
#: linger timer; a huge ``inserts_in_flight`` would start that many threads.
BATCHING_LIMITS: dict[str, Limit] = {
    "max_rows": Limit(1, 2**32),
    "max_bytes": Limit(1, 2**40),
    "early_bytes": Limit(1, 2**40),
    "linger": Limit(0.001, 3_600),
    "inserts_in_flight": Limit(1, 64),
    "max_buffered_bytes": Limit(1, 2**44),
}
RETRY_LIMITS: dict[str, Limit] = {
    "attempts": Limit(1, 1_000),
    "initial_backoff": Limit(0.001, 3_600),
    "max_backoff": Limit(0.001, _DAY),
    "multiplier": Limit(1, 10),
}


def _batching(field: str, kind: type[int] | type[float]) -> Validator:
    return BATCHING_LIMITS[field].check(kind, owner=lambda _: "Batching")


def _retry(field: str, kind: type[int] | type[float]) -> Validator:
    return RETRY_LIMITS[field].check(kind, owner=lambda _: "Retry")


@attrs.frozen(kw_only=True)
class Batching:
    """When a table's buffer is inserted: at ``max_rows`` rows, ``max_bytes``
    bytes, or ``linger`` seconds after its first row, whichever comes first
    (defaults in the spirit of Vector's ClickHouse sink), and, when
    ``early_bytes`` is given, early at that size while no insert of that
    table runs (see :func:`seal_due`; off by default).  At most
    ``inserts_in_flight`` inserts run per table; past ``max_buffered_bytes``
    buffered or in flight, ``submit`` waits."""

    max_rows: int = attrs.field(default=1_000_000, validator=_batching("max_rows", int))
    max_bytes: int = attrs.field(default=10 * 2**20, validator=_batching("max_bytes", int))
    early_bytes: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(_batching("early_bytes", int))
    )
    linger: float = attrs.field(default=1.0, validator=_batching("linger", float))
    inserts_in_flight: int = attrs.field(default=2, validator=_batching("inserts_in_flight", int))
    max_buffered_bytes: int = attrs.field(
        default=DESTINATION_BUFFER_BYTES, validator=_batching("max_buffered_bytes", int)
    )


def seal_due(rows: int, nbytes: int, batching: Batching, *, inserting: bool) -> bool:
    """Whether a buffer of ``rows`` rows and ``nbytes`` bytes becomes an insert
    now: when full (``max_rows`` or ``max_bytes``), or, when ``early_bytes``
    is set and no insert of it runs (``inserting`` false), once it holds
    ``early_bytes``.

    The early seal keeps the insert lane busy while data arrives slower than
    it is written, so what is left for a ``flush()`` is the data of the last
    insert's duration, not up to ``max_bytes`` (a capture's flush at the end
    of a run waited for a whole 10 MiB block sealed just before it).  Under
    load an insert runs and buffers fill to ``max_bytes`` as before.  Each
    insert has a fixed cost (about 5 ms of CPU on chDB whatever its size),
    which ``early_bytes`` bounds.  It is off by default: in the inference
    process, more and smaller inserts during the forward passes cost the
    model more than the shorter flush saves (bench/inference_cost.py, quiet
    machine, early_bytes 2 MiB against off, alternated: MiniLM's forward time
    with capture to chDB 1.14-1.27x against 0.96-1.03x of no hooks, and its
    time until flush returned 1.16-1.31x against 1.01-1.07x).
    """
    if rows >= batching.max_rows or nbytes >= batching.max_bytes:
        return True
    early = batching.early_bytes
    return early is not None and not inserting and nbytes >= early


@attrs.frozen(kw_only=True)
class Retry:
    """Capped exponential backoff for transient insert errors."""

    attempts: int = attrs.field(default=8, validator=_retry("attempts", int))
    initial_backoff: float = attrs.field(default=0.2, validator=_retry("initial_backoff", float))
    max_backoff: float = attrs.field(default=30.0, validator=_retry("max_backoff", float))
    multiplier: float = attrs.field(default=2.0, validator=_retry("multiplier", float))

    def backoff(self, failures: int) -> float:
        """Seconds to wait after the ``failures``-th failure (1-based)."""
        return capped_backoff(self.initial_backoff, self.multiplier, self.max_backoff, failures)
