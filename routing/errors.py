"""Exceptions raised by taproute, one small class per way things go wrong.

Every message names the thing that was wrong (route, processor, destination,
layout, column, output_id, record position) and where it was found.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


class TaprouteError(Exception):
    """Base class of every error taproute raises on purpose."""


# -- configuration: raised while building, before anything is accepted ---------


class ConfigError(TaprouteError, ValueError):
    """A route, schema or destination configuration is invalid."""

    #: Where the problem is, as a configuration key path (``routes[2]``,
    #: ``destinations.db``, ``default_destination``), when the raiser knows it.
    where: str | None = None

    def located(self) -> list[tuple[str, str | None]]:
        """``(message, where)`` for each problem this error reports."""
        return [(str(self), self.where)]


class PlanErrors(ConfigError):
    """Several configuration problems found in one pass; ``errors`` holds each
    (with its own class and ``where``), in the order they were found."""

    def __init__(self, errors: Sequence[ConfigError]) -> None:
        self.errors = tuple(errors)
        listing = "\n".join(
            f"  - {error}" + ("" if error.where is None else f" @ {error.where}")
            for error in self.errors
        )
        super().__init__(f"{len(self.errors)} configuration problems:\n{listing}")

    def located(self) -> list[tuple[str, str | None]]:
        return [pair for error in self.errors for pair in error.located()]


def problem_lines(error: BaseException) -> list[str]:
    """Every problem ``error`` names (why a configuration was refused), one line
    each, at its key path where it has one: a config file's error lists its
    own (``problems``), a :class:`ConfigError` its located ones; another
    error is one line, its type, message and notes (a destination factory's
    error: "opening destination 'db' (its factory raised)")."""
    problems = getattr(error, "problems", None)
    if isinstance(problems, list) and problems:
        return [str(p) for p in problems]
    if isinstance(error, ConfigError):
        return [
            message if where is None else f"{where}: {message}"
            for message, where in error.located()
        ]
    notes = [str(n) for n in getattr(error, "__notes__", ())]
    return [f"{type(error).__name__}: {error}" + "".join(f" ({note})" for note in notes)]


def raise_collected(errors: Sequence[ConfigError]) -> None:
    """Raise the one error found as itself, several as :class:`PlanErrors`, none: return."""
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise PlanErrors(errors)


def at(error: ConfigError, where: str) -> ConfigError:
    """``error`` with its location set (unless it already has one)."""
    if error.where is None:
        error.where = where
    return error


class LayoutError(ConfigError):
    """A layout column has a type that does not map to numpy, or is misplaced."""


class UnknownLayout(ConfigError):
    """A layout name that the ``RecordSchema`` does not define."""


class UnknownProcessor(ConfigError):
    """A route names a processor that no decorator registered."""


class DuplicateProcessor(ConfigError):
    """Two different functions registered under one processor name."""


class UnknownDestination(ConfigError):
    """A route (or the default) names a destination that was not given."""


class DuplicateRouteName(ConfigError):
    """Two routes share a name."""


class HookBindingError(ConfigError):
    """A hook name re-bound with a different layout, or an invalid hook name."""


# -- records: raised at submit, for the offending batch only -------------------


class RecordError(TaprouteError, ValueError):
    """A submitted record is malformed; the batch is refused, nothing else is lost."""


class UnboundOutputId(RecordError):
    """A record carries an output_id that ``bind_hook`` never returned."""


class PayloadSizeMismatch(RecordError):
    """A record's payload length disagrees with its layout, or its range with the buffer."""


class PayloadDtypeMismatch(RecordError):
    """A payload array whose dtype is not its layout's element type: its bytes
    would be read as another type (see :mod:`taproute.routing.payload_dtypes`)."""


class KeyOutOfRange(RecordError):
    """A stateful route's key function gave a key outside ``[0, key_range)``."""


class KeyNotHeld(TaprouteError, ValueError):
    """``complete``/``cancel``/``reopen`` of a request key that no stateful route
    of the running configuration holds: every route's key function maps it
    outside that route's ``[0, key_range)``.  Raised before anything is
    applied; the message names the keys and what each route maps them to."""


class KeyTerminal(RecordError):
    """A record for a key that was completed or cancelled (``reopen`` it to reuse the id)."""


class HandlerMissing(TaprouteError, LookupError):
    """A record parked for a retry whose processor the configuration generation
    it was to be retried under no longer runs (its route was removed or now
    runs another processor): failure code ``handler_missing``."""


class OutputLayoutMismatch(RecordError):
    """A processor returned rows that do not match its registered output layout."""


# -- runtime state ---------------------------------------------------------------


class SinkClosed(TaprouteError, RuntimeError):
    """``submit``, ``flush`` or ``bind_hook`` after ``close``; the message
    names what is closed and the call refused."""


class FlushCutOff(SinkClosed):
    """A ``flush`` that a closing shutdown's grace overtook: the routes or
    destinations it waited for were cut off, and what they held was given up
    rather than delivered (the close raises :class:`ShutdownAbandoned`
    saying how much).  The caller's flush fails; the runtime does not."""


class RerouteRefused(TaprouteError):
    """A dead letter that cannot be rerouted (already rerouted, skipped, or no
    route would take it); it stays as it was."""


class IngressFull(TaprouteError, RuntimeError):
    """Ingress is at capacity and the runtime was built with ``when_full="reject"``."""


class ShutdownAbandoned(TaprouteError, TimeoutError):
    """A close whose shutdown grace ran out: what was still running was cut
    off and what it held given up.

    A :class:`TimeoutError`, as a ``close(timeout=...)`` that ran out always
    raised.  ``grace`` is the grace in seconds; ``busy`` maps each
    destination (``"record sink"`` for a runtime's plain sink) still busy
    then to the call that had not returned (``"submit"``, ``"flush"``,
    ``"close"``; ``"queued"``: batches waited for it behind such a call);
    ``abandoned_records``/``abandoned_batches`` map each destination to what
    was given up there (queued for it or in its unfinished call: never
    delivered); ``busy_routes`` are the routes still processing at the end of
    the grace (records accepted and not done); ``route_records`` are records
    queued in routes' mailboxes or in a processor call that was cut off, and
    ``ingress_records`` records still in the
    runtime's ingress, given up too.
    ``loop_ended`` is False when the loop thread could not be stopped (it is
    blocked in a call that cannot be cancelled: a sink or processor that
    blocks the loop itself, or a worker-thread call that does not let itself
    be abandoned); it then runs on and keeps what it holds.  ``failure`` is a
    failure latched before the shutdown, if any (also ``__cause__``).
    """

    def __init__(
        self,
        grace: float,
        *,
        busy: Mapping[str, str],
        abandoned_records: Mapping[str, int],
        abandoned_batches: Mapping[str, int],
        busy_routes: Sequence[str] = (),
        route_records: int = 0,
        ingress_records: int = 0,
        loop_ended: bool = True,
        failure: BaseException | None = None,
    ) -> None:
        self.grace = grace
        self.busy = dict(busy)
        self.abandoned_records = dict(abandoned_records)
        self.abandoned_batches = dict(abandoned_batches)
        self.busy_routes = tuple(busy_routes)
        self.route_records = route_records
        self.ingress_records = ingress_records
        self.loop_ended = loop_ended
        self.failure = failure
        busy_now = [
            f"{name!r} ({'batches queued' if call == 'queued' else f'in {call}'})"
            for name, call in self.busy.items()
        ] + [f"route {name!r} (processing)" for name in self.busy_routes]
        if busy_now:
            still = ", ".join(busy_now)
            head = f"close: the shutdown grace of {grace:g} s ran out with {still} still busy"
        else:
            head = f"close: the shutdown grace of {grace:g} s ran out"
        lost = [  # no batches: rows the sink had taken and buffered, given up by it
            f"{name!r} {n} records"
            + (f" in {b} batches" if (b := self.abandoned_batches.get(name, 0)) else "")
            for name, n in self.abandoned_records.items()
            if n
        ]
        if route_records:
            lost.append(f"{route_records} records in routes")
        if ingress_records:
            lost.append(f"{ingress_records} records in ingress")
        parts = [head, "abandoned: " + ("; ".join(lost) if lost else "nothing queued")]
        if not loop_ended:
            parts.append(
                "the loop thread is blocked in a call that cannot be cancelled (a sink or "
                "processor blocking the loop itself, or a worker-thread call without "
                "abandon_on_cancel) and runs on, keeping what it holds"
            )
        if failure is not None:
            parts.append(f"an earlier failure was latched: {failure}")
        super().__init__("; ".join(parts))
        if failure is not None:
            self.__cause__ = failure

    @property
    def records(self) -> int:
        """Every record given up (destinations, routes and ingress together)."""
        return sum(self.abandoned_records.values()) + self.route_records + self.ingress_records


class RoutingFailure(TaprouteError, RuntimeError):
    """The first failure latched anywhere in a routing sink.

    Raised by every ``submit``/``flush``/``close`` after the failure.  ``route``
    and ``destination`` say where it happened (``None`` where not applicable);
    the original exception is ``__cause__`` and :attr:`cause`.
    """

    def __init__(
        self,
        cause: BaseException,
        *,
        route: str | None = None,
        destination: str | None = None,
        where: str | None = None,
    ) -> None:
        self.cause = cause
        self.route = route
        self.destination = destination
        self.where = where
        parts = []
        if route is not None:
            parts.append(f"route {route!r}")
        if destination is not None:
            parts.append(f"destination {destination!r}")
        if where is not None:
            parts.append(where)
        place = ", ".join(parts) or "routing sink"
        super().__init__(f"{place} failed: {type(cause).__name__}: {cause}")
        self.__cause__ = cause


class BatchCutShort(RoutingFailure):
    """A routing sink's ``submit`` that an unexpected failure cut short after
    some routes had taken their part of the batch.

    The failure is latched, as any :class:`RoutingFailure` (every later call
    raises it, naming where it happened); this says what is latched (the
    first failure, which may be another task's) for the batch at hand.
    Each record a route, the default destination or the
    ``unmatched="drop"`` count took is counted there, once; ``untaken``
    says how many of the batch's records nothing took: those are the
    caller's to count as given up (the runtime counts them at ingress,
    ``given_up``), and only those.
    """

    def __init__(self, latched: RoutingFailure, *, untaken: int) -> None:
        super().__init__(
            latched.cause,
            route=latched.route,
            destination=latched.destination,
            where=latched.where,
        )
        self.untaken = untaken


class GlobMatchesNothing(UserWarning):
    """A route output pattern matched no bound hook name when the table was built."""
