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
import threading
import time
from collections.abc import Awaitable, Callable

import attrs

from taproute.routing.batch import RecordBatch
from taproute.routing.checks import Limit, Validator, config_check
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
    #: The processor returned :class:`Failed` or raised a transient error
    #: (anything but :class:`InvalidInput` and the :data:`PANIC_TYPES`).
    HANDLER_FAILED = "handler_failed"
    #: No result within the route's deadline.
    HANDLER_TIMEOUT = "handler_timeout"
    #: The processor raised one of the :data:`PANIC_TYPES` (a bug in its code).
    HANDLER_PANIC = "handler_panic"
    #: The record's key was completed or cancelled (dead-lettered only when the
    #: policy's ``terminal_records`` is ``"dead_letter"``).
    KEY_TERMINAL = "key_terminal"
    #: Derived records a causal limit refused (depth or rate per root); their
    #: payload is redacted unless the limits keep it.
    CAUSAL_LIMIT = "causal_limit"
    #: A destination refused the records (bad data, not unreachable).
    DESTINATION_REFUSED = "destination_refused"
    #: A destination's spool was full and its policy is ``dead_letter``.
    SPOOL_FULL = "spool_full"

    @property
    def retryable(self) -> bool:
        """True for the codes a retry may cure."""
        return self in (FailureCode.HANDLER_FAILED, FailureCode.HANDLER_TIMEOUT)


class InvalidInput(Exception):
    """Raised by a processor for input it cannot process (``handler_invalid``, not retried)."""


#: What a *panic* is in Python: the exception classes that mean the processor's
#: own code is wrong (a wrong type, a missing attribute or name, a failed
#: assertion, a bad index or value computed from the record, a missing import,
#: unbounded recursion).  A retry runs the same code on the same records, so
#: these are given up at once (``handler_panic``, traceback kept).  Anything
#: else a processor raises (``ConnectionError``, ``TimeoutError``, other
#: ``OSError``, ``RuntimeError``, an exception class of a client library) is
#: taken as transient: ``handler_failed``, retried with backoff.
PANIC_TYPES: tuple[type[BaseException], ...] = (
    ArithmeticError,
    AssertionError,
    AttributeError,
    ImportError,
    LookupError,
    NameError,
    NotImplementedError,
    RecursionError,
    TypeError,
    ValueError,
)


def classify(error: BaseException) -> FailureCode:
    """The failure code of an exception a processor (or route predicate) raised.

    :class:`InvalidInput` is ``handler_invalid``; a :data:`PANIC_TYPES`
    exception ``handler_panic``; anything else (transient) ``handler_failed``.
    """
    if isinstance(error, InvalidInput):
        return FailureCode.HANDLER_INVALID
    if isinstance(error, PANIC_TYPES):
        return FailureCode.HANDLER_PANIC
    return FailureCode.HANDLER_FAILED


@attrs.frozen
class Failed:
    """Returned by a processor for a transient failure (``handler_failed``, retried).

    ``reason`` says what went wrong: "feature store restarting".
    """

    reason: str


class ProcessorFailed(Exception):
    """The exception form of a :class:`Failed` result, as it is stored and reported."""


_DAY = 86_400.0

#: Bounds of :class:`FailurePolicy`'s numbers, one home: its own validators and
#: config files use these.  A multiplier under 1 would shrink the backoff.
FAILURE_POLICY_LIMITS: dict[str, Limit] = {
    "deadline": Limit(0, _DAY),
    "initial_backoff": Limit(0, _DAY),
    "multiplier": Limit(1, 10),
    "max_backoff": Limit(0, _DAY),
    "max_failures": Limit(0, 1_000),
    "failure_window": Limit(0, 30 * _DAY),
    "max_parked_records": Limit(0, 2**32),
}


def _bounded(field: str, kind: type[int] | type[float]) -> Validator:
    return FAILURE_POLICY_LIMITS[field].check(kind, owner=lambda _: "failure policy")


@attrs.frozen(kw_only=True)
class FailurePolicy:
    """How a route retries and when it gives up.

    A retryable failure waits ``backoff(n)`` after its n-th failure (from
    ``initial_backoff``, times ``multiplier``, at most ``max_backoff``); it is
    given up only once it has failed ``max_failures`` times *and*
    ``failure_window`` seconds have passed since its first failure; then, if
    it holds several records (a stateless batch, a stateful key's records),
    each record is run once more on its own, with no new retry budget, and
    only those that fail again are given up (at most one more call per
    record: a record is tried at most once more than its unit was; a last
    try that times out gives the records after it up untried).  A
    non-retryable failure is given up at once (a batch's records are first
    re-run one by one, so only the bad ones are).  Processors run under
    ``deadline`` seconds (0: no deadline).  Once ``max_parked_records`` wait for
    a retry (or behind a failing key) on a route, the route takes no new
    records until room frees up (backpressure); records already in its
    mailboxes still join, so the bound is that plus the route's ``capacity``.
    A record for a completed or cancelled key (stateful routes) is counted
    as ``terminal`` and dropped (``terminal_records="drop"``) or dead-lettered
    with code ``key_terminal`` (``"dead_letter"``).
    """

    deadline: float = attrs.field(default=5.0, validator=_bounded("deadline", float))
    initial_backoff: float = attrs.field(default=2.0, validator=_bounded("initial_backoff", float))
    multiplier: float = attrs.field(default=2.0, validator=_bounded("multiplier", float))
    max_backoff: float = attrs.field(default=300.0, validator=_bounded("max_backoff", float))
    max_failures: int = attrs.field(default=5, validator=_bounded("max_failures", int))
    failure_window: float = attrs.field(default=900.0, validator=_bounded("failure_window", float))
    max_parked_records: int = attrs.field(
        default=100_000, validator=_bounded("max_parked_records", int)
    )
    terminal_records: str = attrs.field(
        default="drop",
        validator=config_check(
            attrs.validators.in_(("drop", "dead_letter")),
            must="'drop' or 'dead_letter'",
            owner=lambda _: "failure policy",
        ),
    )

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
    epoch; ``traceback`` is set for exceptions a processor raised (not ``InvalidInput``).
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
    #: When the records are a rerouted dead letter's copy: the original letter's id.
    reroute_of: int | None = None
    #: The configuration generation the records were last tried under (None:
    #: a sink without generations).
    generation: int | None = None
    #: Their ids in the route's park store, when they were parked there (a
    #: park store's own handler moves them to the dead letters in one step).
    parked: tuple[int, ...] = ()

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


class GiveUpLog:
    """Warning lines for give-ups, at most ``burst`` per route per ``interval`` seconds.

    Every give-up is logged whatever failure handler is installed (a
    dead-letter store is silent by itself); past the rate, lines are counted
    and the next line that gets through says how many were left out.
    """

    def __init__(self, *, burst: int = 10, interval: float = 60.0) -> None:
        self.burst = burst
        self.interval = interval
        self._lock = threading.Lock()
        #: route -> (window start, lines logged in it, lines left out since the last one)
        self._windows: dict[str, tuple[float, int, int]] = {}

    def __call__(self, failure: RecordFailure) -> bool:
        """Log ``failure`` at warning level unless its route is over the rate; True if logged."""
        now = time.monotonic()
        with self._lock:
            start, logged, left_out = self._windows.get(failure.route, (now, 0, 0))
            if now - start >= self.interval:
                start, logged = now, 0
            if logged >= self.burst:
                self._windows[failure.route] = (start, logged, left_out + 1)
                return False
            self._windows[failure.route] = (start, logged + 1, 0)
        if left_out:
            logger.warning("%s (%d earlier give-up line(s) left out)", failure.message, left_out)
        else:
            logger.warning("%s", failure.message)
        return True


def log_failure(failure: RecordFailure) -> None:
    """The default handler: nothing beyond the give-up warning every route logs.

    Kept as the default so that installing no handler still records each
    give-up once, in the log (rate-limited) and the route's ``failed`` counter.
    """
