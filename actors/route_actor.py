"""What every route actor shares: its plan, counters, destination, and the one
failure path (isolate, park for a retry, or give up).

The record worker calls :meth:`RouteActor.dispatch` with the part of a batch
that matched the route; the route kinds live in ``forward.py`` (hand the
batch on), ``pool.py`` (stateless worker pool) and ``owners.py`` (stateful
key owners).

A failure is classified (:class:`~taproute.routing.failures.FailureCode`).
Retryable ones are parked (:mod:`taproute.actors.retry`) and tried again
after the policy's backoff, without holding other records.  What is given up
goes to the failure handler (the dead-letter store).  A batch that fails for
a non-retryable reason is re-run record by record, so one malformed record
does not take its neighbours down with it (a stateful call over several keys
is re-run key by key first, each key's records in one call, and record by
record only within a key whose call fails again).  A unit of several records
whose retries ran out is not given up whole either: each of its records is
run once more on its own, with no new retry budget, and only those that fail
again are given up (:meth:`RouteActor._last_tries`).  This isolation is
written once, here, for both processing kinds.

A route's predicate (the verdict on a batch, and a failed predicate's
records given up) is :class:`~taproute.actors.route_predicates.RouteScreening`.
"""

from __future__ import annotations

import functools
import inspect
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import numpy.typing as npt
import trio

from taproute.actors.attempt import (
    Attempt,
    Outcome,
    Placement,
    call_processor,
)
from taproute.actors.counters import RouteCounters
from taproute.actors.destination import DestinationActor
from taproute.actors.inflight import InFlight
from taproute.actors.mailbox import Mailbox
from taproute.actors.parking import Parker
from taproute.actors.retry import RetryQueue
from taproute.actors.route_predicates import RouteScreening
from taproute.routing.batch import RecordBatch, RowBatch
from taproute.routing.failures import (
    FailureCode,
    FailureHandler,
    GiveUpLog,
    RecordFailure,
)
from taproute.routing.latch import FailureLatch
from taproute.routing.parking import ParkIds, Restored
from taproute.routing.plan import PlannedRoute

if TYPE_CHECKING:
    from taproute.actors.chain import ChainLink

#: Where a failure cut short a :meth:`RouteActor.restore` is latched.
RESTORING = "restoring parked records"


class RouteActor(RouteScreening):
    """The shared part of every route kind (a forward route uses only the
    dispatch, counters and give-up parts)."""

    def __init__(
        self,
        planned: PlannedRoute,
        destination: DestinationActor,
        *,
        latch: FailureLatch,
        in_flight: InFlight,
        on_failure: FailureHandler,
        hook_name: Callable[[int], str] | None = None,
        give_up_log: GiveUpLog | None = None,
        copy_of: Callable[[RecordBatch], int | None] | None = None,
        parker: Parker | None = None,
    ) -> None:
        self.planned = planned
        #: Where parked records are kept (a store: durable; else memory only).
        self.parker = parker if parker is not None else Parker(None)
        self._give_up_log = give_up_log if give_up_log is not None else GiveUpLog()
        self._copy_of = copy_of
        self.name = planned.name
        self.destination = destination
        self.policy = planned.route.failure_policy
        self.counters = RouteCounters(
            planned.name, planned.route.mode.value, planned.route.destination
        )
        self._hook_name = hook_name
        self._latch = latch
        self._in_flight = in_flight
        self._on_failure = on_failure
        self.mailboxes: list[Mailbox[Any]] = []
        self.limiter = trio.CapacityLimiter(planned.route.workers)
        # Threads are not bounded by `limiter` (a processor past its deadline is
        # abandoned and must not keep its slot); this one only counts them.
        self._threads = trio.CapacityLimiter(math.inf)
        #: Where the processor runs: worker threads, or the loop once it is quick.
        self.placement = Placement()
        #: The same for the route's predicate.
        self.predicate_placement = Placement()
        self.parked: RetryQueue[Any] = RetryQueue(
            self.counters, max_parked=self.policy.max_parked_records, gate=self.parker.retries
        )
        #: Where this route's output is routed again (None: nowhere).
        self.chain: ChainLink | None = None
        #: The configuration generation this actor routes under (set when a
        #: reload swaps it in; the first generation is 1).
        self.generation = 1
        #: Set by a reload that retired this route: its actors drain what they
        #: were given and leave what is parked to be handed to :attr:`successor`.
        self.handing_over = False
        #: The same-named route of the generation that replaced this one, if any.
        self.successor: RouteActor | None = None
        #: The same-named route this one replaced (a stateful route waits for it).
        self.predecessor: RouteActor | None = None
        #: True once every task of this route has exited; :attr:`exited` is set
        #: after that, once what it held was handed over.
        self.tasks_done = False
        self.exited = trio.Event()

    async def dispatch(self, batch: RecordBatch, *, wait: bool = True) -> None:
        """Take ``batch`` (this route's records of one ingress batch, or derived
        records of a chain).  ``wait=False``: queue without waiting for room
        (a chain inside a cycle).

        Raises only before it counted any of ``batch`` accepted: an unexpected
        failure after that is latched and what it left is counted given up
        (:meth:`_cut_dispatch`), so the routing sink knows which records a
        route took."""
        raise NotImplementedError

    async def dispatch_here(self, batch: RecordBatch) -> None:
        """The record worker's :meth:`dispatch`: a route may do the work in the
        calling task when that is quicker than a hop to its own actors (a
        stateless route with a quick processor and an idle pool); by default
        the same as ``dispatch(batch)``."""
        await self.dispatch(batch)

    async def restore(self, restored: Restored, *, copy: bool = False) -> None:
        """Take back records a previous run left parked (tried again at once);
        ``copy``: a rerouted dead letter's copy, parked by this run (counted
        accepted, not restored).

        Like :meth:`dispatch`, an unexpected failure after the records were
        counted accepted is latched, naming this route, and what it had not
        handed on is counted given up (it stays in the park store, for the
        next start); it does not raise."""
        raise NotImplementedError(f"route {self.name!r} ({self.planned.route.mode}) parks nothing")

    async def run(self, nursery: trio.Nursery) -> None:
        """Start the route's actors in ``nursery`` (forward routes have none)."""

    def close(self) -> None:
        """Close the route's mailboxes: its actors drain them, give up what is
        parked, then exit."""
        self.parked.close()
        for mailbox in self.mailboxes:
            mailbox.close()

    def retire(self) -> None:
        """A reload replaced this route: close its inputs like :meth:`close`, but
        what is parked is left for the sink to hand to the successor, not given up."""
        self.handing_over = True
        self.close()

    def abandon(self) -> None:
        """The route's actors are gone (the run was cancelled or raised): give
        back every buffer still queued or parked here, without waiting."""
        for mailbox in self.mailboxes:
            for message in mailbox.take_all():
                batch = self._message_batch(message)
                if batch is not None:
                    self.counters.abandoned += len(batch)
                    self._settle(batch)
        for item in self.parked.drain():
            if isinstance(item, Attempt):
                self._let_go_parked(item)

    def _let_go_parked(self, attempt: Attempt) -> None:
        """Give back a parked ``attempt``'s buffer as the run ends: in a
        durable park store it stays parked for the next start; otherwise it
        is given up here, counted as abandoned (once: its hold goes with it)."""
        if attempt.hold is not None and not self.parker.durable:
            self.counters.abandoned += len(attempt.batch)
        self.parked.release(attempt)

    def _count_given_up(self, records: int, tally: list[int]) -> None:
        """An unexpected failure (latched by the caller) cut short the task
        handling an attempt of ``records`` records: those it had not settled
        (``tally``: processed, dead-lettered, dropped or parked) are counted
        given up, so every record accepted still ends in a count."""
        self.counters.given_up += max(0, records - tally[0])

    def _cut_dispatch(
        self, records: int, tally: list[int], exc: Exception, *, where: str = "route dispatch"
    ) -> None:
        """An unexpected failure cut short :meth:`dispatch` (or :meth:`restore`)
        of ``records`` accepted records: those it had not handed to a mailbox
        or settled (``tally``) are counted given up and the failure is
        latched, naming this route.  The dispatch then returns, as a pool's
        own attempt in the record worker does: had it raised, the runtime
        would count the whole ingress batch given up again (accepted here,
        given up there)."""
        self._count_given_up(records, tally)
        self._latch.latch(exc, route=self.name, where=where)

    def _count_cut(self, records: int, tally: list[int]) -> None:
        """The task handling an attempt of ``records`` records was cancelled (a
        shutdown's grace ran out): those it had not settled (``tally``:
        processed, dead-lettered, dropped or parked, the last counted
        abandoned with the park itself) are counted abandoned, each once.
        (Judged by the route's settled total, a batch partly settled, being
        re-run record by record, had the rest counted nowhere, and a call
        cut off while another worker settled records was not counted.)"""
        self.counters.abandoned += max(0, records - tally[0])

    def _message_batch(self, message: Any) -> RecordBatch | None:
        """The batch a queued message holds a lease on (None: it holds none)."""
        return message.batch if isinstance(message, Attempt) else None

    def snapshot(self) -> RouteCounters:
        """A detached copy of the counters."""
        self.counters.queue_depth = sum(m.records for m in self.mailboxes)
        return attrs.evolve(self.counters, failures_by_code=dict(self.counters.failures_by_code))

    # -- processing: one path for every processing kind -----------------------

    async def _call(self, attempt: Attempt) -> Outcome:
        """Run the processor once on ``attempt`` (kinds add their arguments)."""
        return await self._call_processor(attempt.batch)

    #: Whether a processor call in a worker thread that waited briefly is
    #: charged its CPU time (see ``attempt.THREAD_WAIT_S``), so that a quick
    #: processor sent to threads under load comes back to the loop.
    thread_waits_by_cpu = True

    async def _call_processor(
        self, batch: RecordBatch, *args: Any, prepare: Callable[[], object] | None = None
    ) -> Outcome:
        return await call_processor(
            self.planned,
            batch,
            *args,
            prepare=prepare,
            limiter=self.limiter,
            threads=self._threads,
            hook_name=self._hook_name,
            abandoned=self._abandoned_call,
            placement=self.placement,
            thread_waits_by_cpu=self.thread_waits_by_cpu,
        )

    def _abandoned_call(self, delta: int) -> None:
        self.counters.abandoned_calls += delta

    def _units(self, attempt: Attempt) -> list[Attempt]:
        """What fails together: the whole attempt (stateful routes: one unit per key)."""
        return [attempt]

    def _park(self, unit: Attempt, due: float) -> None:
        """Schedule a held, failed ``unit`` for a retry at ``due``."""
        raise NotImplementedError

    async def _wait_behind(self, head: Attempt, rest: list[Attempt]) -> bool:
        """A record parked during isolation: make ``rest`` wait behind it if order
        is promised (True), or go on with them (False, the default)."""
        return False

    async def _process(self, attempt: Attempt) -> bool:
        """Process ``attempt``; on failure isolate, park or give up. True on success."""
        return await self._handle(attempt, await self._call(attempt))

    async def _handle(self, attempt: Attempt, outcome: Outcome) -> bool:
        """Deliver a successful call's rows; a failed one is isolated, parked or
        given up by the route's policy.  True on success."""
        if outcome.code is None:
            await self._deliver(attempt, outcome.rows)
            return True
        assert outcome.error is not None
        attempt.failed(outcome.code, outcome.error, outcome.traceback)
        self._count_failure(attempt)
        code = outcome.code
        units = self._units(attempt)
        for unit in units:
            if not code.retryable and len(units) > 1:
                # One key's records of a call over several keys: the call's
                # failure may be another key's.  Run again on their own (one
                # call, isolated record by record only if that fails too), so
                # a good key's records are not given up with a bad one's.
                await self._process(unit.afresh())
            elif not code.retryable and len(unit.batch) > 1 and not unit.isolated:
                await self._isolate(unit)
            elif unit.spent or self.policy.gives_up(
                code, unit.failures, unit.first_failure_at, trio.current_time()
            ):
                if len(unit.batch) > 1:
                    # Retries ran out on several records: the failure may be
                    # one record's.  Each runs once more on its own, with no
                    # new budget; only those that fail again are given up.
                    await self._last_tries(unit)
                else:
                    await self._give_up(unit)
            else:
                self.parked.hold(unit)
                unit.scheduled = True
                await self._keep(unit)  # durable before this message is done
                self._park(unit, trio.current_time() + self.policy.backoff(unit.failures))
        return False

    async def _keep(self, attempt: Attempt, *, waiting_behind: int | None = None) -> None:
        """Put parked records in the park store (if any); a store error is latched."""
        try:
            await self.parker.keep(self.name, attempt, waiting_behind=waiting_behind)
        except Exception as exc:
            self._latch.latch(exc, route=self.name, where="park store")

    async def _unpark(self, attempt: Attempt) -> None:
        """Records leave the park store (given up, or discarded and counted)."""
        if attempt.park_ids is not None:
            ids, attempt.park_ids = attempt.park_ids, None
            await self._forget(ids)

    async def _forget(self, ids: ParkIds) -> None:
        try:
            await self.parker.unpark(ids)
        except Exception as exc:
            self._latch.latch(exc, route=self.name, where="park store")

    async def _discard(self, attempt: Attempt) -> None:
        """Drop ``attempt``'s records, counted (a cancel, the terminal ``drop`` policy)."""
        self.counters.dropped += len(attempt.batch)
        attempt.note_settled(len(attempt.batch))
        await self._unpark(attempt)

    async def _isolate(self, unit: Attempt) -> None:
        """Re-run a failed unit record by record, in order, to find the bad one(s)."""
        singles = unit.singles()
        for index, single in enumerate(singles):
            if await self._process(single):
                continue
            if single.scheduled and await self._wait_behind(single, singles[index + 1 :]):
                return

    async def _last_tries(self, unit: Attempt) -> None:
        """A unit of several records whose retries ran out: each record is run
        once more on its own, in order, with the unit's history and no retry
        budget of its own (:meth:`Attempt.last_tries`): delivered if it
        succeeds, given up at its first failure, whatever the code.  So a
        retryable failure one record causes gives up that record alone, and
        isolation costs at most one call per record past the policy's retries
        (a record is tried at most once more than its unit was).

        A last try that times out ends them: the records after it are given
        up untried, with the unit's failure.  A processor that hangs would
        otherwise hold the route for one more deadline per record (a batch
        of thousands, for hours) while the route's mailbox, then ingress,
        fills behind it: at most one deadline is spent finding a bad record."""
        singles = unit.last_tries()
        for index, single in enumerate(singles):
            if await self._process(single) or single.code is not FailureCode.HANDLER_TIMEOUT:
                continue
            for untried in singles[index + 1 :]:
                await self._give_up(untried)
            return

    async def _deliver(self, attempt: Attempt, rows: npt.NDArray[np.void] | None) -> None:
        """Send a successful attempt's rows on; count its records processed."""
        planned = self.planned
        wrote = rows is not None and len(rows) > 0
        if rows is not None and wrote:
            assert planned.output_layout is not None
            self.counters.emitted += len(rows)
            await self.destination.deliver(
                self.name, RowBatch(self.name, planned.output_layout.name, rows)
            )
            if self.chain is not None:
                self.counters.derived += await self.chain.rows(attempt.batch, rows)
        self.counters.processed += len(attempt.batch)
        attempt.note_settled(len(attempt.batch))
        if attempt.failures:
            self.counters.recovered += len(attempt.batch)
        if attempt.park_ids is not None:
            ids, attempt.park_ids = attempt.park_ids, None
            if wrote:
                # Its rows are only in the destination's buffer now: forgotten
                # once the destination flushed them.
                await self.destination.settle(functools.partial(self._forget, ids))
            else:
                await self._forget(ids)

    # -- giving up -------------------------------------------------------------

    async def undeliverable(self, batch: RecordBatch, error: BaseException) -> None:
        """Give up records this route's destination refused because it is closed."""
        await self._reject(Attempt(batch), FailureCode.BINDING_INVALID, error)

    async def _reject(self, attempt: Attempt, code: FailureCode, error: BaseException) -> None:
        """Fail ``attempt`` for a reason no retry can cure, and give it up at once."""
        attempt.failed(code, error, None)
        self._count_failure(attempt)
        await self._give_up(attempt)

    def _count_failure(self, attempt: Attempt) -> None:
        assert attempt.code is not None
        by_code = self.counters.failures_by_code
        by_code[attempt.code.value] = by_code.get(attempt.code.value, 0) + len(attempt.batch)

    async def _give_up(self, attempt: Attempt, *, generation: int | None = None) -> None:
        """Hand ``attempt`` to the failure handler; a handler error is latched.

        ``generation``: the one it was last tried under (default: this route's)."""
        assert attempt.code is not None and attempt.error is not None
        self.counters.failed += len(attempt.batch)
        attempt.note_settled(len(attempt.batch))
        failure = RecordFailure(
            route=self.name,
            processor=self.planned.route.processor,
            error=attempt.error,
            records=attempt.batch,
            code=attempt.code,
            attempts=max(attempt.failures, 1),
            first_failure_at=attempt.first_failure_wall or time.time(),
            last_failure_at=attempt.last_failure_wall or time.time(),
            traceback=attempt.traceback,
            reroute_of=None if self._copy_of is None else self._copy_of(attempt.batch),
            generation=self.generation if generation is None else generation,
            parked=() if attempt.park_ids is None else tuple(attempt.park_ids.tolist()),
        )
        self._give_up_log(failure)  # whatever the handler: an operator sees give-ups in the log
        try:
            result = self._on_failure(failure)
            if inspect.isawaitable(result):
                await result
        except Exception as exc:
            self._latch.latch(exc, route=self.name, where="failure handler (dead letters)")
        else:
            # The handler has them (a park store's own handler already moved
            # them to the dead letters, in the same transaction).
            await self._unpark(attempt)
        finally:
            self.parked.release(attempt)

    # -- mailbox bookkeeping -----------------------------------------------------

    async def _enqueue(
        self, mailbox: Mailbox[Any], message: Any, batch: RecordBatch, *, wait: bool = True
    ) -> None:
        """Queue a message that holds ``batch``: lease, in-flight and backlog."""
        batch.lease.acquire()
        self._in_flight.add()
        self.counters.backlog += len(batch)
        try:
            await mailbox.send(message, records=len(batch), nbytes=batch.nbytes, wait=wait)
        except BaseException:
            self._settle(batch)
            raise

    def _settle(self, batch: RecordBatch) -> None:
        """Undo what :meth:`_enqueue` took, once its message is handled."""
        self.counters.backlog -= len(batch)
        try:
            batch.lease.release()
        except Exception as exc:
            self._latch.latch(exc, route=self.name, where="buffer release callback")
        finally:
            self._in_flight.done()
