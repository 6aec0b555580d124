"""Per-record failures: codes, the retry policy, and what a given-up failure carries.

A processor raising on one malformed record must neither stop the router nor
lose the record.  These failures are not the latched failure of a routing
sink: the route classifies them (:class:`FailureCode`), retries the
retryable ones with bounded backoff (:class:`FailurePolicy`), and hands what
it gives up on to a failure handler — a dead-letter store in production, a
log line by default.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Awaitable, Callable

import attrs

from taproute.routing.batch import RecordBatch
from taproute.routing.checks import NON_NEGATIVE, config_check
from taproute.routing.limits import capped_backoff

logger = logging.getLogger("taproute.routing")


class FailureCode(enum.StrEnum):
    """Why records failed on a route (exported as a counter label)."""

    #: The route's processor is not registered.
    HANDLER_MISSING = "handler_missing"
    #: The route's destination is gone or closed.
    BINDING_INVALID = "binding_invalid"
    #: The route's mode or policy cannot apply to the record (e.g. key out of range).
    POLICY_INVALID = "policy_invalid"
    #: The processor said the input is malformed, or its output failed validation.
    HANDLER_INVALID = "handler_invalid"
    #: The processor returned :class:`Failed` (transient).
    HANDLER_FAILED = "handler_failed"
    #: No result within the route's deadline.
    HANDLER_TIMEOUT = "handler_timeout"
    #: The processor raised anything else.
    HANDLER_PANIC = "handler_panic"

    @property
    def retryable(self) -> bool:
        """True for the codes a retry may cure."""
        return self in (FailureCode.HANDLER_FAILED, FailureCode.HANDLER_TIMEOUT)


class InvalidInput(Exception):
    """Raised by a processor for input it cannot process (``handler_invalid``, not retried)."""


@attrs.frozen
class Failed:
    """Returned by a processor for a transient failure (``handler_failed``, retried).

    ``reason`` says what went wrong: "feature store restarting".
    """

    reason: str


class ProcessorFailed(Exception):
    """The exception form of a :class:`Failed` result, as it is stored and reported."""


_non_negative = config_check(*NON_NEGATIVE, must=">= 0", owner=lambda _: "failure policy")


@attrs.frozen
class FailurePolicy:
    """How a route retries and when it gives up.

    A retryable failure waits ``backoff(n)`` after its n-th failure (from
    ``initial_backoff``, times ``multiplier``, at most ``max_backoff``); it is
    given up only once it has failed ``max_failures`` times *and*
    ``failure_window`` seconds have passed since its first failure.  A
    non-retryable failure is given up at once.  Processors run under
    ``deadline`` seconds (0: no deadline).  Once ``max_parked_records`` wait for
    a retry (or behind a failing key) on a route, the route takes no new
    records until room frees up (backpressure); records already in its
    mailboxes still join, so the bound is that plus the route's ``capacity``.
    """

    deadline: float = attrs.field(default=5.0, validator=_non_negative)
    initial_backoff: float = attrs.field(default=2.0, validator=_non_negative)
    multiplier: float = attrs.field(default=2.0, validator=_non_negative)
    max_backoff: float = attrs.field(default=300.0, validator=_non_negative)
    max_failures: int = attrs.field(default=5, validator=_non_negative)
    failure_window: float = attrs.field(default=900.0, validator=_non_negative)
    max_parked_records: int = attrs.field(default=100_000, validator=_non_negative)

    def backoff(self, failures: int) -> float:
        """Seconds to wait after the ``failures``-th failure (1-based)."""
        return capped_backoff(self.initial_backoff, self.multiplier, self.max_backoff, failures)

    def gives_up(self, code: FailureCode, failures: int, first_at: float, now: float) -> bool:
        """Whether a unit that has now failed ``failures`` times is given up."""
        if not code.retryable:
            return True
        return failures >= self.max_failures and now - first_at >= self.failure_window


@attrs.frozen(eq=False, kw_only=True)
class RecordFailure:
    """Records a route gave up on, and why.

    ``records`` shares the original buffer: a handler that keeps it past the
    call must ``records.retain()``.  Times are wall-clock seconds since the
    epoch; ``traceback`` is set for ``handler_panic``.
    """

    route: str
    processor: str | None
    error: BaseException
    records: RecordBatch
    code: FailureCode = FailureCode.HANDLER_PANIC
    attempts: int = 1
    first_failure_at: float = 0.0
    last_failure_at: float = 0.0
    traceback: str | None = None

    @property
    def message(self) -> str:
        """One line: where, how many records, the code and the error."""
        proc = f", processor {self.processor!r}" if self.processor else ""
        return (
            f"route {self.route!r}{proc}: {len(self.records)} record(s) given up after "
            f"{self.attempts} attempt(s) [{self.code}]: {type(self.error).__name__}: {self.error}"
        )


#: Called with every failure given up on; may be a coroutine function.
FailureHandler = Callable[[RecordFailure], Awaitable[None] | None]


def log_failure(failure: RecordFailure) -> None:
    """The default handler: log a warning (the route's ``failed`` counter counts it)."""
    logger.warning("%s", failure.message)
