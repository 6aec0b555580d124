"""A spooling destination's health and books: whether it takes batches now
(since when, why not), how long to wait before the next try, and what became
of every record it accepted."""

from __future__ import annotations

from collections.abc import Callable

import attrs

from taproute.routing.limits import capped_backoff
from taproute.service.sinks.spool.spool import SpoolCounters


@attrs.frozen(kw_only=True)
class Backoff:
    """Waits between retries of an unreachable destination (capped exponential)."""

    initial: float = 0.5
    multiplier: float = 2.0
    maximum: float = 30.0

    def after(self, failures: int) -> float:
        return capped_backoff(self.initial, self.multiplier, self.maximum, failures)


@attrs.frozen
class Health:
    """Whether the destination takes batches now; since when (clock seconds) and why not."""

    healthy: bool
    since: float
    reason: str | None
    consecutive_failures: int


@attrs.define
class SpoolingCounters:
    """Records through a spooling destination.

    accepted = delivered + refused + shed + held, where refused records went
    to the dead-letter callback (``refused_dropped_records`` of them had no
    place there and were dropped, counted), shed ones were dropped by the
    spool's quota policy (``spool.dropped_records``, ``shed_records`` when a
    ``block`` ran out of time) or dead-lettered by it
    (``spool.dead_lettered_records``), and held ones are in memory or in the
    spool.  ``spilled_records`` went to the spool while the destination was
    healthy: it was behind (its backlog past the threshold), or the spool
    still held batches to deliver first.
    """

    accepted_records: int = 0
    delivered_records: int = 0
    delivered_batches: int = 0
    refused_records: int = 0
    refused_dropped_records: int = 0
    shed_records: int = 0
    spilled_records: int = 0
    retries: int = 0
    memory_records: int = 0
    spool: SpoolCounters = attrs.field(factory=SpoolCounters)


class HealthTracker:
    """The destination's :class:`Health`, moved by each try's outcome."""

    def __init__(self, clock: Callable[[], float], backoff: Backoff) -> None:
        self._clock = clock
        self.backoff = backoff
        self.health = Health(True, clock(), None, 0)
        #: Since when and why the spool's disk fails (an error other than no
        #: room: read-only, I/O error, permission), until a spool write succeeds.
        self.spool_failure: tuple[float, str] | None = None

    def failed(self, error: BaseException, reason: str | None = None) -> None:
        """A try failed transiently: unhealthy since the first such failure
        (``reason``: how the sink words ``error``; default its type and text)."""
        health = self.health
        since = health.since if not health.healthy else self._clock()
        if reason is None:
            reason = f"{type(error).__name__}: {error}"
        self.health = Health(False, since, reason, health.consecutive_failures + 1)

    def spool_failed(self, reason: str) -> bool:
        """The spool's disk refused a write (not for room): True when it is news."""
        failure = self.spool_failure
        self.spool_failure = (self._clock() if failure is None else failure[0], reason)
        return failure is None

    def spool_recovered(self) -> bool:
        """A spool write succeeded: True when its disk had failed."""
        failed, self.spool_failure = self.spool_failure is not None, None
        return failed

    @property
    def reported(self) -> Health:
        """:attr:`health` as reported: also unhealthy while the spool's disk fails
        (the destination may still be reached: batches that need the spool are shed)."""
        if self.spool_failure is None:
            return self.health
        since, reason = self.spool_failure
        if not self.health.healthy:
            since = min(since, self.health.since)
            reason = f"{reason}; {self.health.reason}"
        return Health(False, since, reason, self.health.consecutive_failures)

    def succeeded(self) -> None:
        if not self.health.healthy:
            self.health = Health(True, self._clock(), None, 0)

    def wait(self) -> float:
        """Seconds to wait before the next try (0 while healthy)."""
        if self.health.healthy:
            return 0.0
        return self.backoff.after(self.health.consecutive_failures)


__all__ = ["Backoff", "Health", "HealthTracker", "SpoolingCounters"]
