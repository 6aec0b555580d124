"""When and how a ClickHouseSink inserts: :class:`Batching` (when a table's
buffer becomes an insert, how many run at once, how much may wait) and
:class:`Retry` (the backoff for transient insert errors)."""

from __future__ import annotations

from typing import Any

import attrs

from taproute.routing.errors import ConfigError
from taproute.routing.limits import capped_backoff


def _positive(_: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if value <= 0:
        raise ConfigError(f"{attribute.name} must be > 0, got {value!r}")


@attrs.frozen
class Batching:
    """When a table's buffer is inserted: at ``max_rows`` rows, ``max_bytes``
    bytes, or ``linger`` seconds after its first row, whichever comes first
    (defaults in the spirit of Vector's ClickHouse sink).  At most
    ``inserts_in_flight`` inserts run per table; past ``max_buffered_bytes``
    buffered or in flight, ``submit`` waits."""

    max_rows: int = attrs.field(default=1_000_000, validator=_positive)
    max_bytes: int = attrs.field(default=10 * 2**20, validator=_positive)
    linger: float = attrs.field(default=1.0, validator=_positive)
    inserts_in_flight: int = attrs.field(default=2, validator=_positive)
    max_buffered_bytes: int = attrs.field(default=256 * 2**20, validator=_positive)


@attrs.frozen
class Retry:
    """Capped exponential backoff for transient insert errors."""

    attempts: int = attrs.field(default=8, validator=_positive)
    initial_backoff: float = attrs.field(default=0.2, validator=_positive)
    max_backoff: float = attrs.field(default=30.0, validator=_positive)
    multiplier: float = attrs.field(default=2.0, validator=_positive)

    def backoff(self, failures: int) -> float:
        """Seconds to wait after the ``failures``-th failure (1-based)."""
        return capped_backoff(self.initial_backoff, self.multiplier, self.max_backoff, failures)
