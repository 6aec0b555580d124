"""Route actors: forward, stateless pool, stateful owners, and their failure handling.

The record worker calls :meth:`RouteActor.dispatch` with the part of a batch
that matched the route.  A forward route hands it straight to its destination
actor; a stateless route queues it for a pool of workers; a stateful route
splits it by key owner and queues each part for that owner.  Processors run
in worker threads under the route's deadline and its own concurrency limit.

A failure is classified (:class:`FailureCode`).  Retryable ones are parked
and tried again after the policy's backoff, without holding other records;
on a stateful route a failing key's later records wait behind it (order is
the promise) while other keys flow.  What is given up goes to the failure
handler (the dead-letter store).  A batch that fails for a non-retryable
reason is re-run record by record, so one malformed record does not take its
neighbours down with it.
"""

from __future__ import annotations

import heapq
import inspect
import itertools
import math
import time
import traceback
from collections import deque
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import trio

from taproute.actors.counters import RouteCounters
from taproute.actors.destination import DestinationActor
from taproute.actors.inflight import InFlight
from taproute.actors.latch import FailureLatch
from taproute.actors.mailbox import Mailbox
from taproute.native import StateRegion, partition_keys
from taproute.routing.batch import RecordBatch, Retained, RowBatch
from taproute.routing.errors import KeyOutOfRange, OutputLayoutMismatch
from taproute.routing.failures import (
    Failed,
    FailureCode,
    FailureHandler,
    InvalidInput,
    ProcessorFailed,
    RecordFailure,
)
from taproute.routing.plan import PlannedRoute
from taproute.routing.records import Records
from taproute.routing.validation import check_rows

Keys = npt.NDArray[np.int64]


@attrs.define(eq=False)
class Attempt:
    """Records on their way through a route, with their failure history."""

    batch: RecordBatch
    keys: Keys | None = None
    failures: int = 0
    first_failure_at: float = 0.0  # trio clock, for the give-up window
    first_failure_wall: float = 0.0
    last_failure_wall: float = 0.0
    code: FailureCode | None = None
    error: BaseException | None = None
    traceback: str | None = None
    isolated: bool = False
    scheduled: bool = False  # parked with a retry due (the head of its key, if stateful)
    hold: Retained | None = None

    def failed(self, code: FailureCode, error: BaseException, tb: str | None) -> None:
        """Note one more failure."""
        now_wall = time.time()
        if self.failures == 0:
            self.first_failure_at = trio.current_time()
            self.first_failure_wall = now_wall
        self.failures += 1
        self.last_failure_wall = now_wall
        self.code, self.error, self.traceback = code, error, tb

    def part(self, selection: npt.NDArray[np.intp]) -> Attempt:
        """The records at ``selection``, with this attempt's history."""
        return attrs.evolve(
            self,
            batch=self.batch.select(selection),
            keys=None if self.keys is None else self.keys[selection],
            hold=None,
            scheduled=False,
        )


@attrs.frozen
class _Outcome:
    rows: npt.NDArray[np.void] | None = None
    code: FailureCode | None = None
    error: BaseException | None = None
    traceback: str | None = None


class RouteActor:
    """What every route kind shares: its plan, counters, destination and failure handling."""

    def __init__(
        self,
        planned: PlannedRoute,
        destination: DestinationActor,
        *,
        latch: FailureLatch,
        in_flight: InFlight,
        on_failure: FailureHandler,
        hook_name: Callable[[int], str] | None = None,
    ) -> None:
        self.planned = planned
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
        workers = planned.route.workers
        self.limiter = trio.CapacityLimiter(workers)
        # Threads are not bounded by `limiter` (a processor past its deadline is
        # abandoned and must not keep its slot); this one only counts them.
        self._threads = trio.CapacityLimiter(math.inf)
        self._parked: list[tuple[float, int, Any]] = []
        self._parked_seq = itertools.count()
        self._retry_wake = trio.lowlevel.ParkingLot()
        self._room = trio.lowlevel.ParkingLot()
        self._closing = False

    async def dispatch(self, batch: RecordBatch) -> None:
        """Take ``batch`` (this route's records of one ingress batch)."""
        raise NotImplementedError

    async def run(self, nursery: trio.Nursery) -> None:
        """Start the route's actors in ``nursery`` (forward routes have none)."""

    def close(self) -> None:
        """Close the route's mailboxes: its actors drain them, give up what is
        parked, then exit."""
        self._closing = True
        self._retry_wake.unpark_all()
        for mailbox in self.mailboxes:
            mailbox.close()

    def snapshot(self) -> RouteCounters:
        """A detached copy of the counters."""
        self.counters.queue_depth = sum(m.records for m in self.mailboxes)
        return attrs.evolve(self.counters, failures_by_code=dict(self.counters.failures_by_code))

    # -- processing --------------------------------------------------------

    def _records(self, batch: RecordBatch) -> Records | RecordBatch:
        layout = self.planned.input_layout
        return Records(batch, layout, self._hook_name) if layout else batch

    async def _call(self, batch: RecordBatch, *args: Any) -> _Outcome:
        """Run the processor under the deadline and classify what came back."""
        planned = self.planned
        if planned.processor is None:
            return _Outcome(code=FailureCode.HANDLER_MISSING, error=LookupError("no processor"))
        fn = planned.processor.fn
        deadline = self.policy.deadline or math.inf
        try:
            async with self.limiter:
                with trio.move_on_after(deadline) as scope:
                    result = await trio.to_thread.run_sync(
                        fn,
                        self._records(batch),
                        *args,
                        limiter=self._threads,
                        abandon_on_cancel=True,
                    )
            if scope.cancelled_caught:
                return _Outcome(
                    code=FailureCode.HANDLER_TIMEOUT,
                    error=TimeoutError(f"no result within the route's {deadline:g} s deadline"),
                )
        except InvalidInput as exc:
            return _Outcome(code=FailureCode.HANDLER_INVALID, error=exc)
        except Exception as exc:
            return _Outcome(
                code=FailureCode.HANDLER_PANIC, error=exc, traceback=traceback.format_exc()
            )
        if isinstance(result, Failed):
            return _Outcome(code=FailureCode.HANDLER_FAILED, error=ProcessorFailed(result.reason))
        if result is None:
            return _Outcome()
        assert planned.output_layout is not None and planned.processor is not None
        try:
            rows = check_rows(
                result, planned.output_layout, route=self.name, processor=planned.processor.name
            )
        except OutputLayoutMismatch as exc:
            return _Outcome(code=FailureCode.HANDLER_INVALID, error=exc)
        return _Outcome(rows=rows)

    async def _deliver(self, attempt: Attempt, rows: npt.NDArray[np.void] | None) -> None:
        """Send a successful attempt's rows on; count its records processed."""
        planned = self.planned
        if rows is not None and len(rows):
            assert planned.output_layout is not None
            self.counters.emitted += len(rows)
            await self.destination.deliver(
                self.name, RowBatch(self.name, planned.output_layout.name, rows)
            )
        self.counters.processed += len(attempt.batch)
        if attempt.failures:
            self.counters.recovered += len(attempt.batch)

    async def undeliverable(self, batch: RecordBatch, error: BaseException) -> None:
        """Give up records this route's destination refused because it is closed."""
        await self._reject(Attempt(batch), FailureCode.BINDING_INVALID, error)

    async def _reject(self, attempt: Attempt, code: FailureCode, error: BaseException) -> None:
        """Fail ``attempt`` for a reason no retry can cure, and give it up at once."""
        attempt.failed(code, error, None)
        self._count_failure(attempt)
        await self._give_up(attempt)

    def _note_failure(self, attempt: Attempt, outcome: _Outcome) -> None:
        assert outcome.code is not None and outcome.error is not None
        attempt.failed(outcome.code, outcome.error, outcome.traceback)
        self._count_failure(attempt)

    def _count_failure(self, attempt: Attempt) -> None:
        assert attempt.code is not None
        by_code = self.counters.failures_by_code
        by_code[attempt.code.value] = by_code.get(attempt.code.value, 0) + len(attempt.batch)

    async def _give_up(self, attempt: Attempt) -> None:
        """Hand ``attempt`` to the failure handler; a handler error is latched."""
        assert attempt.code is not None and attempt.error is not None
        self.counters.failed += len(attempt.batch)
        failure = RecordFailure(
            self.name,
            self.planned.route.processor,
            attempt.error,
            attempt.batch,
            attempt.code,
            max(attempt.failures, 1),
            attempt.first_failure_wall or time.time(),
            attempt.last_failure_wall or time.time(),
            attempt.traceback,
        )
        try:
            result = self._on_failure(failure)
            if inspect.isawaitable(result):
                await result
        except Exception as exc:
            self._latch.latch(exc, route=self.name, where="failure handler (dead letters)")
        finally:
            self._unhold(attempt)

    def _hold(self, attempt: Attempt) -> None:
        if attempt.hold is None:
            attempt.hold = attempt.batch.retain()
            self.counters.parked += len(attempt.batch)

    def _unhold(self, attempt: Attempt) -> None:
        if attempt.hold is not None:
            attempt.hold.release()
            attempt.hold = None
            self.counters.parked -= len(attempt.batch)
            if self._room:
                self._room.unpark_all()

    async def _wait_for_room(self) -> None:
        """Backpressure: wait while too many records are parked on this route."""
        while self.counters.parked >= self.policy.max_parked_records and not self._closing:
            await self._room.park()

    def _schedule(self, due: float, item: Any) -> None:
        heapq.heappush(self._parked, (due, next(self._parked_seq), item))
        self._retry_wake.unpark_all()

    async def _retry_loop(self) -> None:
        """Hand each parked item back when its backoff has passed."""
        while not self._closing:
            if not self._parked:
                await self._retry_wake.park()
                continue
            due = self._parked[0][0]
            if trio.current_time() < due:
                with trio.move_on_at(due):
                    await self._retry_wake.park()
                continue
            _, _, item = heapq.heappop(self._parked)
            self.counters.retries += 1
            await self._retry(item)
        await self._shutdown_parked()

    async def _retry(self, item: Any) -> None:
        raise NotImplementedError

    async def _shutdown_parked(self) -> None:
        """At close: give up everything still waiting for a retry."""

    # -- mailbox bookkeeping -------------------------------------------------

    async def _enqueue(self, mailbox: Mailbox[Any], message: Any, batch: RecordBatch) -> None:
        """Queue a message that holds ``batch``: lease, in-flight and backlog."""
        batch.lease.acquire()
        self._in_flight.add()
        self.counters.backlog += len(batch)
        try:
            await mailbox.send(message, records=len(batch), nbytes=batch.nbytes)
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


class ForwardRoute(RouteActor):
    """Hands batches to the destination as they are: no copy, no actor hop of its own."""

    async def dispatch(self, batch: RecordBatch) -> None:
        self.counters.processed += len(batch)
        self.counters.emitted += len(batch)
        await self.destination.deliver(self.name, batch)


class StatelessRoute(RouteActor):
    """A pool of ``workers`` actors sharing one mailbox; processors run concurrently."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        route = self.planned.route
        self.mailbox: Mailbox[Attempt] = Mailbox(
            f"route {self.name}",
            capacity_records=route.capacity,
            capacity_bytes=route.capacity_bytes,
        )
        self.mailboxes = [self.mailbox]

    async def dispatch(self, batch: RecordBatch) -> None:
        await self._wait_for_room()
        await self._enqueue(self.mailbox, Attempt(batch), batch)

    async def run(self, nursery: trio.Nursery) -> None:
        for _ in range(self.planned.route.workers):
            nursery.start_soon(self._worker)
        nursery.start_soon(self._retry_loop)

    async def _worker(self) -> None:
        while True:
            try:
                attempt = await self.mailbox.receive()
            except trio.EndOfChannel:
                return
            try:
                await self._attempt(attempt)
            except Exception as exc:
                self._latch.latch(exc, route=self.name, where="stateless worker")
            finally:
                self._settle(attempt.batch)

    async def _attempt(self, attempt: Attempt) -> None:
        outcome = await self._call(attempt.batch)
        if outcome.code is None:
            await self._deliver(attempt, outcome.rows)
            return
        self._note_failure(attempt, outcome)
        code = outcome.code
        if not code.retryable and len(attempt.batch) > 1 and not attempt.isolated:
            for i in range(len(attempt.batch)):  # find the bad record(s)
                single = Attempt(attempt.batch.select(np.array([i])), isolated=True)
                await self._attempt(single)
            return
        if self.policy.gives_up(
            code, attempt.failures, attempt.first_failure_at, trio.current_time()
        ):
            await self._give_up(attempt)
            return
        self._hold(attempt)
        self._schedule(trio.current_time() + self.policy.backoff(attempt.failures), attempt)

    async def _retry(self, item: Any) -> None:
        attempt: Attempt = item
        try:
            await self._enqueue(self.mailbox, attempt, attempt.batch)
        finally:
            # The mailbox message now holds the buffer; no worker can see the
            # attempt before this runs (no checkpoint after the send).
            self._unhold(attempt)

    async def _shutdown_parked(self) -> None:
        while self._parked:
            _, _, attempt = heapq.heappop(self._parked)
            await self._give_up(attempt)


@attrs.frozen
class _RetryKey:
    key: int


class StatefulRoute(RouteActor):
    """``workers`` owner actors, each holding one contiguous key range of the
    route's K x N state; a key's records are processed by one owner, in order.
    A failing record holds the later records of its key until it succeeds or
    is given up; other keys flow."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        route = self.planned.route
        spec = self.planned.processor
        assert spec is not None and spec.key_range is not None and spec.slot is not None
        self.key_function = spec.key
        self.key_range = spec.key_range
        self.state = StateRegion(spec.key_range, spec.slot.shape, spec.slot.dtype, route.workers)
        self.owner_mailboxes: list[Mailbox[Any]] = [
            Mailbox(
                f"route {self.name} owner {j}",
                capacity_records=route.capacity,
                capacity_bytes=route.capacity_bytes,
            )
            for j in range(route.workers)
        ]
        self.mailboxes = list(self.owner_mailboxes)
        #: key -> attempts waiting for it (the head is the failing one), per owner.
        self.held: list[dict[int, deque[Attempt]]] = [{} for _ in range(route.workers)]
        self.counters.valid_slots = 0

    def _owner_of(self, key: int) -> int:
        return key * len(self.owner_mailboxes) // self.key_range

    async def dispatch(self, batch: RecordBatch) -> None:
        await self._wait_for_room()
        try:
            keys = self._keys(batch)
        except Exception as exc:
            await self._reject(Attempt(batch), FailureCode.POLICY_INVALID, exc)
            return
        per_owner, bad = partition_keys(keys, self.key_range, len(self.owner_mailboxes))
        if bad is not None:
            first = int(bad[0])
            await self._reject(
                Attempt(batch.select(bad), keys[bad]),
                FailureCode.POLICY_INVALID,
                KeyOutOfRange(
                    f"route {self.name!r}: key {int(keys[first])} of record {first} is outside "
                    f"[0, {self.key_range}); {len(bad)} record(s) not processed"
                ),
            )
        for owner, selection in enumerate(per_owner):
            if selection is None:
                continue
            part = batch if len(selection) == len(batch) else batch.select(selection)
            await self._enqueue(self.owner_mailboxes[owner], (part, keys[selection]), part)

    def _keys(self, batch: RecordBatch) -> Keys:
        assert self.key_function is not None
        keys = np.ascontiguousarray(self.key_function(batch.descriptors), dtype=np.int64)
        if keys.shape != (len(batch),):
            raise KeyOutOfRange(
                f"route {self.name!r}: key function returned shape {keys.shape}, "
                f"expected ({len(batch)},)"
            )
        return keys

    async def run(self, nursery: trio.Nursery) -> None:
        for owner, mailbox in enumerate(self.owner_mailboxes):
            nursery.start_soon(self._owner, owner, mailbox)
        nursery.start_soon(self._retry_loop)

    async def _owner(self, owner: int, mailbox: Mailbox[Any]) -> None:
        held = self.held[owner]
        while True:
            try:
                message = await mailbox.receive()
            except trio.EndOfChannel:
                break
            if isinstance(message, _RetryKey):
                try:
                    await self._retry_key(held, message.key)
                except Exception as exc:
                    self._latch.latch(exc, route=self.name, where="stateful owner")
                finally:
                    self._in_flight.done()
                continue
            batch, keys = message
            try:
                await self._admit(held, Attempt(batch, keys))
            except Exception as exc:
                self._latch.latch(exc, route=self.name, where="stateful owner")
            finally:
                self._settle(batch)
        # Closing: what still waits behind a failing key is given up, in order.
        for queue in held.values():
            while queue:
                attempt = queue.popleft()
                if attempt.code is None:
                    attempt.failed(
                        FailureCode.POLICY_INVALID,
                        RuntimeError("shut down while waiting behind a failing record of its key"),
                        None,
                    )
                await self._give_up(attempt)
        held.clear()

    async def _admit(self, held: dict[int, deque[Attempt]], attempt: Attempt) -> None:
        """Queue records of held keys behind them; process the rest."""
        assert attempt.keys is not None
        if held:
            waiting = np.isin(attempt.keys, np.fromiter(held, dtype=np.int64))
            if waiting.any():
                for key in np.unique(attempt.keys[waiting]).tolist():
                    part = attempt.part(np.flatnonzero(attempt.keys == key))
                    self._hold(part)
                    held[key].append(part)
                free = np.flatnonzero(~waiting)
                if not len(free):
                    return
                attempt = attempt.part(free)
        await self._attempt(held, attempt)

    async def _attempt(self, held: dict[int, deque[Attempt]], attempt: Attempt) -> bool:
        """Process ``attempt``; on failure park or give up per key. True on success."""
        assert attempt.keys is not None
        outcome = await self._call(attempt.batch, attempt.keys, self.state)
        if outcome.code is None:
            self.state.valid[attempt.keys] = True
            self.counters.valid_slots = self.state.valid_slots
            await self._deliver(attempt, outcome.rows)
            return True
        self._note_failure(attempt, outcome)
        code = outcome.code
        keys = np.unique(attempt.keys).tolist()
        for key in keys:
            unit = attempt if len(keys) == 1 else attempt.part(np.flatnonzero(attempt.keys == key))
            if not code.retryable and len(unit.batch) > 1 and not unit.isolated:
                await self._isolate(held, key, unit)
            else:
                await self._park_or_give_up(held, key, unit)
        return False

    async def _isolate(self, held: dict[int, deque[Attempt]], key: int, unit: Attempt) -> None:
        """Re-run a failed unit record by record, in order, to find the bad one(s)."""
        assert unit.keys is not None
        singles = [
            Attempt(unit.batch.select(np.array([i])), unit.keys[i : i + 1], isolated=True)
            for i in range(len(unit.batch))
        ]
        for index, single in enumerate(singles):
            if await self._attempt(held, single):
                continue
            queue = held.get(key)
            if queue and queue[0] is single:
                # Parked for a retry: the rest of the unit waits right behind it.
                for offset, rest in enumerate(singles[index + 1 :], start=1):
                    self._hold(rest)
                    queue.insert(offset, rest)
                return

    async def _park_or_give_up(
        self, held: dict[int, deque[Attempt]], key: int, attempt: Attempt
    ) -> None:
        assert attempt.code is not None
        if self.policy.gives_up(
            attempt.code, attempt.failures, attempt.first_failure_at, trio.current_time()
        ):
            await self._give_up(attempt)
            return
        self._hold(attempt)
        attempt.scheduled = True
        held.setdefault(key, deque()).appendleft(attempt)
        self._schedule(trio.current_time() + self.policy.backoff(attempt.failures), key)

    async def _retry(self, item: Any) -> None:
        key: int = item
        # Through the owner's mailbox, so the owner alone touches its held keys.
        # In flight until the owner has handled it, so a flush waits for it.
        self._in_flight.add()
        try:
            await self.owner_mailboxes[self._owner_of(key)].send(
                _RetryKey(key), records=0, nbytes=0
            )
        except trio.ClosedResourceError:
            self._in_flight.done()  # closing: the owner gives up what it holds

    async def _retry_key(self, held: dict[int, deque[Attempt]], key: int) -> None:
        """Try a held key's head again, then the records that waited behind it."""
        queue = held.get(key)
        while queue:
            head = queue.popleft()
            head.scheduled = False
            self._unhold(head)
            await self._attempt(held, head)
            if queue and queue[0].scheduled:
                return  # failed again: parked at the front with a new backoff
        held.pop(key, None)
