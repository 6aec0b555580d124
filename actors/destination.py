"""Destination actors: one per destination sink, fed through a mailbox.

A sink never sees two calls at once, and sees each route's batches in the
order they were delivered.  The actor calls its sink's ``submit`` for what
is queued; a batch delivered while the actor is idle (nothing queued, no
submit under way) to a sink whose submits have been quick is submitted by
the deliverer itself, which saves a lone batch a task wake-up and a
scheduler pass; the actor waits for such a submit to end before it handles
anything queued meanwhile.  Whatever happens, every message's lease is
returned and its in-flight count removed, so buffers go back and flush never
hangs.

A shutdown whose grace runs out *cuts* a destination still busy
(:meth:`DestinationActor.cut`): the sink call under way is cancelled (one
running in a worker thread is abandoned if it was started with
``abandon_on_cancel``), the sink's background task is cancelled, and every
batch queued for it, or delivered to it later, is given back at once and
counted as abandoned, so the routes and the other destinations finish.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import attrs
import trio

from taproute.actors.attempt import Placement
from taproute.actors.counters import DestinationCounters
from taproute.actors.cuttable import CuttableCalls
from taproute.actors.fairness import YIELD_AFTER_S
from taproute.actors.inflight import InFlight
from taproute.actors.mailbox import Mailbox
from taproute.routing.batch import Batch, RecordBatch
from taproute.routing.errors import ConfigError, RoutingFailure, SinkClosed, at
from taproute.routing.hooks import HookRegistry
from taproute.routing.latch import FailureLatch
from taproute.routing.limits import RELEASE_WITHIN_S
from taproute.routing.sink import (
    BoundsBlocking,
    CountsInsertErrors,
    GivesUp,
    NamesHooks,
    RecordSink,
    ReleasesWhenCut,
    ReportsReach,
    RunsInBackground,
    Spools,
    WaitsForDelivery,
    not_async,
)

#: A destination given as a sink is leased; given as a factory, the routing
#: sink creates it at start and closes it at close.
DestinationSpec = RecordSink | Callable[[], RecordSink]


def is_sink(value: object) -> bool:
    """A sink instance (a sink *class* is a factory, though it has the methods)."""
    return not isinstance(value, type) and isinstance(value, RecordSink)


async def release_unclosed(sink: object) -> None:
    """Let go of what ``sink``, an owned sink whose ``run()`` ended without
    its ``close()``, holds (its transport, a spool's files and lock), if it
    can (:class:`~taproute.routing.sink.ReleasesWhenCut`): shielded, so
    that the cancellation that ended the run does not stop it, and bounded
    by :data:`~taproute.routing.limits.RELEASE_WITHIN_S`.  Idempotent, as the sink's method is."""
    if isinstance(sink, ReleasesWhenCut):
        with trio.move_on_after(RELEASE_WITHIN_S, shield=True):
            await sink.release_when_cut()


def is_sink_failure(exc: BaseException) -> bool:
    """Whether ``exc``, raised by a sink's call, is the sink's failure (latched,
    its records counted, the loop goes on), not the loop's own stop: every
    exception but cancellation, ``KeyboardInterrupt`` and ``GeneratorExit``
    (a group holding one of those included).  A ``SystemExit`` a sink raises
    is its failure: it would otherwise end the loop with the destination's
    records uncounted (counted abandoned, as at a shutdown)."""
    stops = (trio.Cancelled, KeyboardInterrupt, GeneratorExit)
    if isinstance(exc, BaseExceptionGroup):
        return exc.split(stops)[0] is None
    return not isinstance(exc, stops)


class RawSender(Protocol):
    """A route that hands its records to a destination as they are (a forward
    route): told what the sink took of them, or refused because it is closed.

    The route itself travels with its batches, not its name: after a reload
    another route may have that name (with counters of its own, another mode,
    another processor), and the records belong to the route that took them."""

    @property
    def name(self) -> str: ...

    def taken(self, records: int) -> None:
        """The sink took ``records`` of this route's records."""

    def not_taken(self, records: int) -> None:
        """The sink raised on ``records`` of this route's records (a failure,
        latched): never delivered, given up."""

    async def undeliverable(self, batch: RecordBatch, error: BaseException) -> None:
        """The sink refused ``batch`` because it is closed: give it up."""


#: Who delivered a batch: a route's name (its rows), the route itself (its raw
#: records), or None (unmatched records for the default destination).
Sender = str | RawSender | None


@attrs.frozen(eq=False)
class Settle:
    """A marker behind a retried parked record's output: once the destination
    actor reaches it, that output is in the sink; ``forget`` (forgetting the
    records in the park store) runs once the sink has flushed it."""

    forget: Callable[[], Awaitable[None]]


#: (who delivered it, batch or settle marker)
DestinationMessage = tuple[Sender, Batch | Settle]

#: Markers wait for one flush of the sink together: at most this many, this
#: long (seconds) while batches keep coming; at once when the mailbox is empty.
_SETTLE_MAX = 64
_SETTLE_AFTER = 1.0


class DestinationActor:
    """Owns the submit side of one :class:`RecordSink`.

    Built inert from a sink (leased: flushed, never closed) or a factory
    (owned: created by :meth:`open` at start, closed by :meth:`close`).  The
    sink's optional capabilities are checked once, when it is taken.
    """

    def __init__(
        self,
        name: str,
        spec: DestinationSpec,
        *,
        latch: FailureLatch,
        in_flight: InFlight,
        capacity_records: int,
        capacity_bytes: int,
    ) -> None:
        if not (is_sink(spec) or callable(spec)):
            raise ConfigError(
                f"destination {name!r}: expected a RecordSink (submit/flush/close) or a "
                f"factory returning one, got {type(spec).__name__}"
            )
        self.name = name
        self.owned = not is_sink(spec)
        if not self.owned:
            self._check_async(spec)
        self._spec = spec
        #: The sink, once :meth:`open` has taken (or, when owned, created) it.
        self.sink: RecordSink | None = None
        #: The sink's background task, when it has one and this actor owns it.
        self.background: RunsInBackground | None = None
        self._spools: Spools | None = None
        #: The sink, when it can give up records it took.
        self._gives_up: GivesUp | None = None
        self._insert_errors: CountsInsertErrors | None = None
        self._reach: ReportsReach | None = None
        self.counters = DestinationCounters(name)
        self._latch = latch
        self._in_flight = in_flight
        self.mailbox: Mailbox[DestinationMessage] = Mailbox(
            f"destination {name}", capacity_records=capacity_records, capacity_bytes=capacity_bytes
        )
        self._settling: list[Settle] = []
        self._settling_since = 0.0
        #: Whether the sink's submits have been quick enough for a deliverer to
        #: make one itself (the processors' rule: quick calls in a row earn it,
        #: a long or waiting call loses it).
        self.placement = Placement()
        #: The actor waits on its empty mailbox (it is doing nothing else).
        self._receiving = False
        #: A deliverer is inside the sink's submit; the actor waits for it.
        self._submitting = False
        self._submitted = trio.lowlevel.ParkingLot()
        #: Batches submitted by their deliverer (for tests and profiles).
        self.submitted_here = 0
        #: The sink calls under way (``"submit"``, ``"flush"``, ``"close"``),
        #: which a cut cancels.
        self._calls = CuttableCalls()
        #: Set by :meth:`cut`: nothing more reaches the sink.
        self.is_cut = False
        #: Wraps the sink's background task (when owned): a cut cancels it.
        self._background_scope = trio.CancelScope()
        #: :meth:`close` asked the owned sink to close: its close lets go of
        #: what it holds, even cancelled (not :meth:`run_background`).
        self._close_started = False
        #: Who lets go of an owned sink not closed is settled: the end of its
        #: run task (:meth:`run_background`), or :meth:`release_if_unclosed`.
        self._release_settled = False

    def open(self, hooks: HookRegistry, blocking_budget: float | None = None) -> RecordSink:
        """Take the sink (creating it when owned) and check its capabilities, once;
        hand it the producer's ``blocking_budget`` (seconds) if it bounds waits."""
        try:
            made: object = self._spec() if self.owned else self._spec  # type: ignore[operator]
        except ConfigError as exc:  # say which destination's factory refused, and where
            text = exc.args[0] if exc.args and isinstance(exc.args[0], str) else None
            if text is not None and not any(
                named in text for named in (repr(self.name), f"destinations.{self.name}")
            ):
                exc.args = (f"destination {self.name!r}: {text}", *exc.args[1:])
            at(exc, f"destinations.{self.name}")
            raise
        except Exception as exc:  # its own type kept (callers catch it), the place added
            exc.add_note(f"opening destination {self.name!r} (its factory raised)")
            raise
        if not is_sink(made):
            raise ConfigError(
                f"destination {self.name!r}: factory returned {type(made).__name__}, "
                "not a RecordSink"
            )
        if self.owned:
            self._check_async(made)
        sink: RecordSink = made  # type: ignore[assignment]
        if isinstance(sink, RunsInBackground):
            if self.owned:
                self.background = sink
            elif not sink.running:
                raise ConfigError(
                    f"destination {self.name!r} is a leased sink whose run() task is not "
                    "running; start it first, or give a factory so the routing sink owns it"
                )
        if isinstance(sink, NamesHooks):
            sink.use_hooks(hooks)
        if blocking_budget is not None and isinstance(sink, BoundsBlocking):
            sink.use_blocking_budget(blocking_budget)
        self._spools = sink if isinstance(sink, Spools) else None
        self._gives_up = sink if isinstance(sink, GivesUp) else None
        self._insert_errors = sink if isinstance(sink, CountsInsertErrors) else None
        self._reach = sink if isinstance(sink, ReportsReach) else None
        self.sink = sink
        return sink

    async def run_background(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Host the owned sink's ``run()`` task (started with ``nursery.start``)
        until its close, or until a cut (which cancels it), saying which
        destination's task failed: one that fails to start keeps its
        exception (a note names the destination); one that fails once running
        raises a :class:`RoutingFailure` naming the destination, which the
        runtime latches as it is (it read "runtime loop failed: OSError")."""
        assert self.background is not None
        self._release_settled = True
        started = False

        class _Started:
            def started(self, value: object = None) -> None:
                nonlocal started
                started = True
                task_status.started(value)

        try:
            with self._background_scope:
                await self.background.run(task_status=_Started())
        except Exception as exc:
            if not started:
                exc.add_note(f"starting destination {self.name!r} (its run() task)")
                raise
            raise RoutingFailure(exc, destination=self.name, where="its run() task") from exc
        finally:
            # A sink not closed (cut: see close(); or its run ended without a
            # close, the nursery cancelled or a task failed): let go of its
            # transport here, without waiting for the calls abandoned.
            if self.is_cut or not self._close_started:
                await release_unclosed(self.background)

    async def release_if_unclosed(self) -> None:
        """The routing sink's run ends: an owned sink :meth:`open` created
        that was not closed (cut, or the run ended first: cancelled, another
        destination failed to open or start) and whose own run task did not
        let go of it (it has none, or it never started) lets go of what it
        holds now (see :func:`release_unclosed`).  Once."""
        if not self.owned or self.sink is None or self._release_settled:
            return
        if self._close_started and not self.is_cut:
            return  # its close lets go of what it holds, even cancelled
        self._release_settled = True
        await release_unclosed(self.sink)

    def _check_async(self, sink: object) -> None:
        problem = not_async(sink)
        if problem is not None:
            raise at(
                ConfigError(f"destination {self.name!r}: {problem}"), f"destinations.{self.name}"
            )

    async def deliver(self, route: Sender, batch: Batch) -> None:
        """Queue ``batch`` for the sink, taking a lease on raw batches.
        ``route``: who delivers it (see :data:`Sender`).

        Waits while the mailbox is full.  When the actor is idle and the
        sink's submits have been quick, submits it here instead (the same
        counting, failure handling and lease) and returns once the sink took it.
        """
        if self.is_cut:
            self._count_abandoned(batch)
            return
        if isinstance(batch, RecordBatch):
            batch.lease.acquire()
        self._in_flight.add()
        if self._receiving and not self._submitting and self.mailbox.idle and self.placement.inline:
            self._submitting = True
            self.submitted_here += 1
            try:
                await self._submit(route, batch)
            finally:
                self._submitting = False
                if self._submitted:
                    self._submitted.unpark_all()
                self._finished(batch)
            return
        try:
            await self.mailbox.send((route, batch), records=len(batch), nbytes=batch.nbytes)
        except BaseException as exc:
            if isinstance(exc, trio.Cancelled):
                self._count_abandoned(batch)
            self._finished(batch)
            raise

    async def settle(self, forget: Callable[[], Awaitable[None]]) -> None:
        """Run ``forget`` once what was delivered here before is flushed by the sink.

        Markers are settled together: when the mailbox has no batch left, or
        at most ``_SETTLE_MAX`` markers or ``_SETTLE_AFTER`` seconds later
        while batches keep coming.  In flight (a flush waits) until settled.
        """
        self._in_flight.add()
        try:
            await self.mailbox.send((None, Settle(forget)), records=0, nbytes=0)
        except BaseException:
            self._in_flight.done()
            raise

    async def _settle_if_due(self) -> None:
        pending = self._settling
        if not pending or not (
            self.mailbox.records == 0
            or len(pending) >= _SETTLE_MAX
            or trio.current_time() - self._settling_since >= _SETTLE_AFTER
        ):
            return
        self._settling = []
        try:
            await self.flush()
            if not self.is_cut:  # cut: never flushed, the records stay parked
                for marker in pending:
                    await marker.forget()
        except Exception:
            pass  # latched (flush) or by ``forget`` itself; the records stay parked
        finally:
            for _ in pending:
                self._in_flight.done()

    async def run(self) -> None:
        """Submit every queued batch, in order, until the mailbox is closed."""
        sink = self.sink
        assert sink is not None, "open() the destination before running it"
        resumed = time.perf_counter()
        while True:
            # Queued batches are drained without a scheduler trip for each (a
            # hop costs more than the work), but the loop is handed over once
            # this task has run YIELD_AFTER_S: every other task on the loop
            # (HTTP, the record worker, timers) waits that long per round, not
            # for a run of sink submits however slow they are.
            if time.perf_counter() - resumed >= YIELD_AFTER_S:
                await trio.lowlevel.checkpoint()
                resumed = time.perf_counter()
            await self._settle_if_due()
            self._receiving = True
            waits = self.mailbox.messages == 0
            try:
                route, batch = await self.mailbox.receive()
            except trio.EndOfChannel:
                await self._direct_submit_ended()
                await self._settle_if_due()
                return
            finally:
                self._receiving = False
            if waits:  # it waited: a schedule point just passed
                resumed = time.perf_counter()
            await self._direct_submit_ended()
            if isinstance(batch, Settle):
                if not self._settling:
                    self._settling_since = trio.current_time()
                self._settling.append(batch)
                continue
            try:
                await self._submit(route, batch)
            finally:
                self._finished(batch)

    async def _direct_submit_ended(self) -> None:
        """Wait until no deliverer is inside the sink's submit (one that began
        while the actor was idle): the sink never sees two calls at once, and
        what was queued meanwhile goes in after it."""
        while self._submitting:
            await self._submitted.park()

    async def _submit(self, route: Sender, batch: Batch) -> None:
        """Hand ``batch`` to the sink, counted; a failure is latched, or (the sink
        closed, raw records of a route) given up by that route."""
        sink = self.sink
        assert sink is not None
        if self.is_cut:
            self._count_abandoned(batch)
            return
        sender: RawSender | None
        if route is None or isinstance(route, str):
            sender, name = None, route
        else:
            sender, name = route, route.name
        started = time.perf_counter()
        elapsed = math.inf  # until the submit returned
        try:
            try:
                returned = await self._call("submit", sink.submit, batch)
                elapsed = time.perf_counter() - started
            finally:
                self.placement.took(elapsed)
        except trio.Cancelled:
            self._count_abandoned(batch)
            raise
        except SinkClosed as exc:
            # The destination is gone: a per-record failure of the route
            # (binding_invalid, dead-lettered), not a failure of the router.
            self.counters.errors += 1
            if sender is None or not isinstance(batch, RecordBatch):
                self.counters.failed_records += len(batch)
                self._latch.latch(exc, route=name, destination=self.name, where="submit")
            else:
                await sender.undeliverable(batch, exc)
        except BaseException as exc:
            if not is_sink_failure(exc):
                raise
            # Latched; the sink did not take the batch: never delivered, counted
            # here and (raw records) given up by their route.
            self.counters.errors += 1
            self.counters.failed_records += len(batch)
            if sender is not None and isinstance(batch, RecordBatch):
                sender.not_taken(len(batch))
            self._latch.latch(exc, route=name, destination=self.name, where="submit")
        else:
            if not returned:  # cut while the sink had it: never delivered
                self._count_abandoned(batch)
                return
            self.counters.records += len(batch)
            self.counters.bytes += batch.nbytes
            self.counters.batches += 1
            if sender is not None and isinstance(batch, RecordBatch):
                sender.taken(len(batch))

    async def _call(self, what: str, fn: Callable[..., Awaitable[Any]], *args: Any) -> bool:
        """Await ``fn(*args)``, a call of the sink, where :meth:`cut` can cancel
        it: True once it returned, False when a cut cancelled it.  A submit
        (once per batch, usually returning at once) enters its cancel scope
        only if it waits; a flush or close, first."""
        return await self._calls.run(what, fn(*args), scope_when_waiting=what == "submit")

    @property
    def busy(self) -> str | None:
        """What keeps this destination busy now: the sink call under way
        (``"submit"``, ``"flush"``, ``"close"``), ``"queued"`` when batches wait
        for it (none under way), else None."""
        if under_way := self._calls.under_way:
            return under_way
        if self._submitting or self.mailbox.messages:
            return "queued"
        return None

    def cut(self) -> str | None:
        """Stop waiting for this destination (a shutdown's grace ran out);
        returns what kept it busy (:attr:`busy`).

        Cancels the sink call under way and, for a sink this actor owns, its
        background task (a writer process sink kills its process then);
        gives back every batch queued for it, counted as abandoned, as it
        does from now on for every batch delivered to it, without a call of
        the sink.  Not undone: the destination takes nothing more.
        """
        busy = self.busy
        if self.is_cut:
            return self.counters.cut_short
        self.is_cut = True
        self.counters.cut_short = busy
        self._calls.cut()
        if self.background is not None:
            self._background_scope.cancel()
        self.abandon()
        return busy

    def _count_abandoned(self, batch: Batch | Settle) -> None:
        if not isinstance(batch, Settle):
            self.counters.abandoned_records += len(batch)
            self.counters.abandoned_batches += 1

    def abandon(self) -> None:
        """The actor is gone (the run was cancelled or raised, or it was cut):
        give back the leases of every batch still queued, without waiting,
        counted as abandoned (records whose settle marker never ran stay
        parked)."""
        for _, batch in self.mailbox.take_all():
            self._count_abandoned(batch)
            self._finished(batch)
        for _ in self._settling:
            self._in_flight.done()
        self._settling = []

    def _finished(self, batch: Batch | Settle) -> None:
        try:
            if isinstance(batch, RecordBatch):
                batch.lease.release()
        except Exception as exc:
            self._latch.latch(exc, destination=self.name, where="buffer release callback")
        finally:
            self._in_flight.done()

    async def flush(self) -> None:
        """Flush the sink; a failure is latched and raised."""
        if self.sink is None or self.is_cut:
            return  # never opened: nothing was submitted; cut: nothing more is asked of it
        try:
            flushed = await self._call("flush", self.sink.flush)
        except Exception as exc:
            self.counters.errors += 1
            raise self._latch.latch(exc, destination=self.name, where="flush") from exc
        if flushed:
            self.counters.flushes += 1

    async def wait_delivered(self) -> None:
        """Wait until the sink delivered everything it took (a spool drained), if it
        can tell; a failure is latched and raised."""
        if not isinstance(self.sink, WaitsForDelivery) or self.is_cut:
            return
        try:
            await self._call("flush", self.sink.wait_delivered)
        except Exception as exc:
            self.counters.errors += 1
            raise self._latch.latch(exc, destination=self.name, where="flush") from exc

    async def close(self) -> None:
        """Close the sink if the routing sink created it; a failure is latched and raised."""
        if not self.owned or self.sink is None or self.is_cut:
            # A cut sink is not asked to flush again: its background task is
            # cancelled, and it released its transport then (run_background).
            return
        self._close_started = True
        try:
            await self._call("close", self.sink.close)
        except Exception as exc:
            self.counters.errors += 1
            raise self._latch.latch(exc, destination=self.name, where="close") from exc

    def _count_given_up(self) -> None:
        """Records the sink took and then gave up (a cut, a close that stopped
        waiting): handed over (still counted sent), never delivered."""
        if self._gives_up is not None:
            self.counters.given_up_records = max(
                self.counters.given_up_records, self._gives_up.given_up_records()
            )

    def snapshot(self) -> DestinationCounters:
        """A detached copy of the counters."""
        self._count_given_up()
        if self._insert_errors is not None:
            self.counters.insert_errors = self._insert_errors.insert_errors()
        self.counters.queue_depth = self.mailbox.records
        if self._spools is not None:
            spool = self._spools.spool_status()
            return attrs.evolve(
                self.counters,
                healthy=spool.healthy,
                unhealthy_since=spool.unhealthy_since,
                unhealthy_reason=spool.reason,
                spool_bytes=spool.bytes,
                spool_segments=spool.segments,
                spool_oldest_age_seconds=spool.oldest_unacked_age_s,
                spool_drained_records=spool.drained_records,
                spool_shed_records=spool.shed_records,
                refused_records=spool.refused_records,
            )
        if self._reach is not None:  # no spool, but the sink knows (a ClickHouse sink)
            reach = self._reach.reach()
            return attrs.evolve(
                self.counters,
                healthy=reach.healthy,
                unhealthy_since=reach.unhealthy_since,
                unhealthy_reason=reach.reason,
            )
        return attrs.evolve(self.counters)
