"""The producer-facing runtime: a Trio loop in its own thread behind a
thread-safe ``submit``, and nothing else.

It owns the thread, the ingress and the record worker that feeds the record
sink; the controls ordered with the records (flush, close, keys, reload) are
:class:`~taproute.service.host.sink_controls.SinkControls`, the producer's
submit calls :class:`~taproute.service.host.producer_calls.ProducerCalls`.
What else runs on
the same loop (the HTTP endpoint, operator controls) is composed around it
by :class:`~taproute.service.host.service.RecordService`, which is what
:func:`~taproute.service.host.service.create_record_runtime` returns.

Crossing into Trio costs one ``run_sync_soon`` per wake-up, never one per
record.  ``submit_batch`` never copies the payload; ``submit`` copies its
(small) payload into the batch it is coalesced into.

Shutdown is bounded by a grace (``shutdown_grace``, or ``close(timeout)``):
within it, ``close`` drains, flushes and closes as it always did; once it
runs out, what still runs is cut off (see :meth:`RecordRuntime.close`), the
loop thread ends, and :class:`~taproute.routing.errors.ShutdownAbandoned`
says which destinations were still busy and what was given up.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Literal, Self

import trio

from taproute.actors.counters import Observable, ReportsStore, RouterSnapshot
from taproute.actors.destination import is_sink, release_unclosed
from taproute.actors.fairness import scheduled_now, yield_if_due
from taproute.routing.batch import RecordBatch
from taproute.routing.errors import BatchCutShort, ConfigError, ShutdownAbandoned, SinkClosed
from taproute.routing.hooks import HookRegistry
from taproute.routing.intake import Intake
from taproute.routing.keys import KeyAction
from taproute.routing.limits import (
    COALESCE_RECORDS,
    QUEUE_BYTES,
    QUEUE_RECORDS,
    SHUTDOWN_GRACE_S,
)
from taproute.routing.producer import Producer
from taproute.routing.schema import RecordSchema
from taproute.routing.sink import (
    BoundsBlocking,
    CutsShort,
    DescribesRecords,
    EndsKeys,
    NamesHooks,
    RecordSink,
    Reloads,
    ReportsFailure,
    RunsInBackground,
    TakesCheckedBatches,
    not_async,
)
from taproute.service.host.batch_merge import SpansPayloads, merge, mergeable
from taproute.service.host.closing import ClosesOnExit
from taproute.service.host.counters import IngressCounters, ServiceSnapshot
from taproute.service.host.ingress import WAKE_DELAY_S, Ingress, WhenFull, thread_wait
from taproute.service.host.ingress_control import Control
from taproute.service.host.producer_calls import ProducerCalls
from taproute.service.host.reload_outcomes import ReloadLedger
from taproute.service.host.runtime_options import check_runtime_options
from taproute.service.host.sink_controls import SinkControls

#: Something else to host on the runtime's loop: started with ``nursery.start``
#: before the runtime reports itself running, cancelled once the sink is closed.
LoopTask = Callable[..., Awaitable[object]]

#: The end of a shutdown's grace kept for the destinations that finished, once
#: those still busy are cut off: this many seconds, at most a quarter of it.
CUT_RESERVE_S = 5.0

#: How long ``close`` waits past the grace for the cancelled loop thread to
#: end before it reports the thread blocked (cancelling takes no time; a
#: writer process killed at the deadline is reaped in that time).
LOOP_END_S = 2.0


def check_grace(value: object, key: str = "shutdown_grace") -> float:
    """``value`` as a shutdown grace: seconds >= 0 (``math.inf``: no bound)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or math.isnan(value)
        or value < 0
    ):
        found = f"{type(value).__name__} {value!r}"
        raise ConfigError(
            f"{key}: expected seconds >= 0 (a number; math.inf: no bound), found {found}"
        )
    return float(value)


def check_grace_timeout(timeout: object) -> float:
    """``close(timeout)`` as seconds (``math.inf``: no bound), checked as a
    thread wait's timeout is (:func:`thread_wait`)."""
    bounded = thread_wait(timeout)  # type: ignore[arg-type]  # checks what it is given
    return math.inf if bounded is None else float(bounded)


def _loop_error(exc: BaseException) -> Exception:
    """What the loop's death by ``exc`` is reported as (an Exception)."""
    return exc if isinstance(exc, Exception) else RuntimeError(f"loop stopped: {exc!r}")


def _sole(exc: BaseException) -> BaseException:
    """The one exception inside nested one-member groups (Trio nurseries wrap)."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


class RecordRuntime(SinkControls, ProducerCalls, Producer[ServiceSnapshot], ClosesOnExit):
    """Hosts a record sink on a Trio loop in a dedicated thread: the sync shell
    of the producer surface (:mod:`taproute.routing.producer`).

    Thread-safe: ``submit``/``submit_batch``/``bind_hook``/``flush`` may be
    called from any thread.  :meth:`host` adds tasks to run on the same loop
    (the service object hosts its HTTP endpoint this way).  Usually created, with
    whatever serves around it, by :func:`create_record_runtime`; on its own:
    ``RecordRuntime(sink).start()``.
    """

    def __init__(
        self,
        record_sink: RecordSink,
        *,
        schema: RecordSchema | None = None,
        hooks: HookRegistry | None = None,
        capacity_records: int = QUEUE_RECORDS,
        capacity_bytes: int = QUEUE_BYTES,
        when_full: WhenFull = "block",
        coalesce_records: int = COALESCE_RECORDS,
        name: str = "taproute",
        max_block: float | None = None,
        arena: SpansPayloads | None = None,
        wake_delay: float = WAKE_DELAY_S,
        shutdown_grace: float = SHUTDOWN_GRACE_S,
    ) -> None:
        if not is_sink(record_sink):
            hint = (
                f" (the class itself; give an instance: {record_sink.__name__}(...))"
                if isinstance(record_sink, type)
                else " (a factory is taken only as a RoutingSink destination; call it)"
                if callable(record_sink)
                else ""
            )
            raise TypeError(
                "record_sink: expected a RecordSink instance (submit/flush/close), found "
                f"{type(record_sink).__name__} {record_sink!r:.80}{hint}"
            )
        problem = not_async(record_sink)
        if problem is not None:
            raise TypeError(f"record_sink: {problem}")
        check_runtime_options(
            schema=schema,
            hooks=hooks,
            capacity_records=capacity_records,
            capacity_bytes=capacity_bytes,
            coalesce_records=coalesce_records,
            name=name,
            max_block=max_block,
            wake_delay=wake_delay,
        )
        if max_block is not None and not max_block >= 0:
            raise ValueError(f"max_block must be seconds >= 0 or None, got {max_block!r}")
        if not (wake_delay >= 0 and math.isfinite(wake_delay)):
            raise ValueError(f"wake_delay must be finite seconds >= 0, got {wake_delay!r}")
        #: Seconds :meth:`close` takes at most (when not given a timeout)
        #: before it cuts off what still runs (``math.inf``: no bound).
        self.shutdown_grace = check_grace(shutdown_grace)
        self.record_sink = record_sink
        #: How long :meth:`offer_batch` may wait for ingress room (None: no bound).
        self.max_block = max_block
        self._loop_tasks: list[LoopTask] = []
        # The sink's optional capabilities, checked once (routing/sink.py lists them).
        described = record_sink if isinstance(record_sink, DescribesRecords) else None
        self._background = record_sink if isinstance(record_sink, RunsInBackground) else None
        self._observable = record_sink if isinstance(record_sink, Observable) else None
        self._reports_failure = record_sink if isinstance(record_sink, ReportsFailure) else None
        self._keys = (
            {
                KeyAction.COMPLETE: record_sink.complete,
                KeyAction.CANCEL: record_sink.cancel,
                KeyAction.REOPEN: record_sink.reopen,
            }
            if isinstance(record_sink, EndsKeys)
            else None
        )
        self._reloads = record_sink if isinstance(record_sink, Reloads) else None
        self.schema: RecordSchema | None = (
            schema if schema is not None else None if described is None else described.schema
        )
        sink_hooks = None if described is None else described.hooks
        if hooks is not None and sink_hooks is not None and hooks is not sink_hooks:
            raise ValueError("hooks given twice: the record sink already has a HookRegistry")
        if hooks is None:
            hooks = sink_hooks if sink_hooks is not None else HookRegistry()
        # A sink that checks with this registry and schema shares its intake: a
        # batch is checked once, here in the producer's call, and handed on as checked.
        self._submit: Callable[[RecordBatch], Awaitable[None]] = record_sink.submit
        checked = record_sink if isinstance(record_sink, TakesCheckedBatches) else None
        if (
            checked is not None
            and checked.intake.hooks is hooks
            and checked.intake.schema is self.schema
        ):
            super().__init__(checked.intake)
            self._submit = checked.submit_checked
        else:
            super().__init__(Intake(hooks, self.schema))
        if isinstance(record_sink, NamesHooks):
            record_sink.use_hooks(hooks)
        if max_block is not None and isinstance(record_sink, BoundsBlocking):
            record_sink.use_blocking_budget(max_block)  # a spool at its quota waits no longer
        self.name = name
        #: Where captured payloads lie, so the batches of one wake-up can be
        #: merged into one without a copy (None: each batch goes on alone).
        self._arena = arena
        self._ingress = Ingress(
            capacity_records=capacity_records,
            capacity_bytes=capacity_bytes,
            when_full=when_full,
            coalesce_records=coalesce_records,
            wake_delay=wake_delay,
        )
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._wakeup = trio.Event()
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        # The shutdown grace: set by close, kept by a task on the loop.
        self._grace_started = trio.Event()
        self._cut_at = self._stop_at = math.inf  # time.monotonic()
        self._main_scope: trio.CancelScope | None = None
        self._sink_call = None
        #: What was still busy when the grace ran out: destination -> call,
        #: and the routes still processing when the loop was cancelled.
        self._busy: dict[str, str] = {}
        self._busy_routes: list[str] = []
        #: The grace ran out and the loop was cancelled as a whole.
        self._stopped_short = False
        #: The record sink's close returned (the grace is kept no longer).
        self._sink_closed = False
        #: Records (and batches) a plain record sink had when cancelled.
        self._sink_abandoned = [0, 0]
        self._shutdown_lock = threading.Lock()
        self._shutdown_error: ShutdownAbandoned | None = None
        #: Stores reported in the snapshot besides the record sink's (the
        #: service's dead-letter store when its sink is not a routing sink).
        self._stores: list[ReportsStore] = []
        self._queued_swaps = set()
        self.reload_ledger = ReloadLedger()

    # -- lifecycle ---------------------------------------------------------

    def host(self, task: LoopTask) -> None:
        """Run ``task`` on the loop too (before :meth:`start`): started with
        ``nursery.start`` before the sink takes records, cancelled after it closed."""
        if self._thread is not None:
            raise RuntimeError("loop tasks are added before the runtime starts")
        self._loop_tasks.append(task)

    def start(self) -> Self:
        """Start the loop thread and the sink (and the loop tasks); returns once
        all are running."""
        if self._thread is not None:
            raise RuntimeError("runtime already started")
        self._thread = threading.Thread(target=self._thread_main, name=self.name, daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            self._thread.join()
            raise self._start_error
        return self

    def _thread_main(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # the loop died: refuse producers, fail waiters
            exc = _sole(exc)  # a sink refusing to start is its error, not a nursery's group
            error = _loop_error(exc)
            if not self._ready.is_set():
                self._start_error = error
            failure = self._latch.latch(error, where="runtime loop")
            # What producers had queued will never be routed: given up, counted.
            items = self._ingress.fail(failure, loop_gone=True)
            self._give_up(items, failure, count="given_up")
        else:
            if self._stopped_short:  # what is still in ingress is given up, counted
                gone = SinkClosed("runtime stopped: the shutdown grace ran out")
                self._give_up(self._ingress.fail(gone, loop_gone=True), gone, count="abandoned")
        finally:
            self._ready.set()

    def _give_up(
        self,
        items: Sequence[object],
        error: BaseException,
        *,
        count: Literal["abandoned", "given_up"],
    ) -> None:
        """Fail the controls among ``items`` with ``error`` and release the
        batches, counted at ingress as ``count`` (``abandoned``: a shutdown's
        grace ran out; ``given_up``: the runtime failed): nothing will take
        them any more."""
        for item in items:
            if isinstance(item, Control):
                if not item.future.done():
                    if isinstance(item.kind, KeyAction):
                        self._ingress.count_failed_key_control()
                    item.future.set_exception(error)
            elif isinstance(item, RecordBatch):
                if count == "abandoned":
                    self._ingress.counters.abandoned += len(item)
                else:
                    self._ingress.counters.given_up += len(item)
                with contextlib.suppress(Exception):  # a release callback's own failure
                    item.lease.release()

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._wakeup = trio.Event()
        self._ingress.connect(self._schedule_wake)
        async with trio.open_nursery() as nursery:
            self._main_scope = nursery.cancel_scope
            nursery.start_soon(self._keep_grace)
            if self._background is not None:
                await nursery.start(self._run_background)
            for task in self._loop_tasks:
                await nursery.start(task)
            self._ready.set()
            await self._record_worker()
            nursery.cancel_scope.cancel()  # the sink is closed; stop the loop tasks

    async def _run_background(self, *, task_status: trio.TaskStatus[None]) -> None:
        """The record sink's ``run()`` task.  The sink is the runtime's: one
        whose run ends before a close reached it (a loop task failed, the
        loop was cancelled) lets go of its transport here (a ClickHouse
        sink's chDB session stayed open for the life of the process)."""
        assert self._background is not None
        try:
            await self._background.run(task_status=task_status)
        finally:
            if not self._sink_close_started:
                await release_unclosed(self._background)

    async def _keep_grace(self) -> None:
        """A loop task: once :meth:`close` started the grace, cut off the
        destinations still busy near its end and, at its end, cancel the loop."""
        await self._grace_started.wait()
        await trio.sleep(max(0.0, self._cut_at - time.monotonic()))
        if self._sink_closed:  # closed in time; the loop is stopping
            return
        self._cut()
        await trio.sleep(max(0.0, self._stop_at - time.monotonic()))
        if self._sink_closed:
            return
        self._cut()
        if self._observable is not None:  # what the cancel below cuts short
            routes = self._observable.snapshot().routes
            for name, r in routes.items():
                if r.backlog > 0 and name not in self._busy_routes:
                    self._busy_routes.append(name)
        self._stopped_short = True
        assert self._main_scope is not None
        self._main_scope.cancel()

    def _cut(self) -> None:
        """Cut off what is still busy (a routing sink's destinations), noting what."""
        sink = self.record_sink
        if isinstance(sink, CutsShort):
            for route in sink.cut_routes():  # first: the close then reaches the destinations
                if route not in self._busy_routes:
                    self._busy_routes.append(route)
            for name, call in sink.cut_short().items():
                self._busy.setdefault(name, call)
        elif self._sink_call is not None:
            self._busy.setdefault("record sink", self._sink_call)

    def _schedule_wake(self) -> None:
        # Called by producers with the ingress lock held.
        assert self._token is not None
        # RunFinishedError: the loop died and its thread has not yet emptied
        # ingress (that needs the lock we hold). What was just queued is failed
        # there with the loop's error, so the caller learns why, not that Trio ended.
        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(self._wake)

    def _wake(self) -> None:
        # A run_sync_soon callback: must never raise.
        self._wakeup.set()

    async def _record_worker(self) -> None:
        ingress = self._ingress
        idle_since: float | None = None  # when the polls began finding nothing
        while True:
            # Capture hooks don't wake the loop (see ingress): while batches
            # arrive, a poll every wake_delay takes them; once the polls found
            # nothing for park_after the worker parks, and the next batch wakes it.
            if (
                idle_since is not None
                and trio.current_time() - idle_since >= ingress.park_after
                and ingress.park()
            ):
                await self._wakeup.wait()
            else:
                with trio.move_on_after(ingress.wake_delay or math.inf):
                    await self._wakeup.wait()
            scheduled_now()  # a processor call made in this task need not yield again
            woken = self._wakeup.is_set()
            if woken:
                self._wakeup = trio.Event()
            items = ingress.take()
            if items or woken:
                idle_since = None
            elif idle_since is None:
                idle_since = trio.current_time()
            if not items:
                continue
            # Ingress capacity is given back once per wake-up, not per batch:
            # one lock round trip and one producer wake-up for the lot.
            records = nbytes = empty = 0
            run: list[RecordBatch] = []  # batches to merge, in queue order
            position = 0
            started = False  # items[position] is being handled (or is in `run`)
            try:
                for position, item in enumerate(items):  # noqa: B007 - read on cancel
                    started = False
                    if isinstance(item, RecordBatch):
                        records += len(item)
                        nbytes += item.payload.nbytes
                        if not len(item):
                            empty += 1  # its one record's room, given back the same
                        if self._arena is not None and mergeable(item):
                            run.append(item)
                            started = True
                            continue
                    if run:
                        await self._hand_on(run)
                    started = True
                    if isinstance(item, Control):
                        # What was handed on before it has its room back before
                        # the control settles: a flush() that returned finds
                        # that room free (a capture block's bounded end is not
                        # shed as if ingress were still stalled).
                        self._ingress.done(records, nbytes)
                        records = nbytes = 0
                        # Its own room (a key control's, a flush's or reload's;
                        # a close takes none) goes back as it settles, so a
                        # snapshot taken after flush() returned counts no
                        # control queued (_control gives it back exactly once).
                        if await self._control(item):
                            self._sink_closed = True
                            return
                    else:
                        await self._hand_on([item])
                    # A full ingress is many batches: hand the loop to the other
                    # tasks (HTTP, destinations, timers) between them, not only
                    # once it is all handed on.
                    await yield_if_due()
                if run:
                    await self._hand_on(run)
            except trio.Cancelled:  # the grace ran out: what was taken and not handed on
                gone = SinkClosed("runtime stopped: the shutdown grace ran out")
                left = items[position + 1 if started else position :]
                self._give_up([*run, *left], gone, count="abandoned")
                raise
            except BaseException as exc:
                # The loop dies (a sink raised past Exception: SystemExit, ...):
                # what was taken and not handed on is given up, counted, and
                # its controls fail, as what is still in ingress will.
                failure = self._latch.latch(_loop_error(exc), where="runtime loop")
                left = items[position + 1 if started else position :]
                self._give_up([*run, *left], failure, count="given_up")
                raise
            finally:
                self._ingress.done(records, nbytes, empty=empty)

    async def _hand_on(self, batches: list[RecordBatch]) -> None:
        """Submit ``batches`` (taken in this order) to the record sink, merged
        into one when the arena spans their payloads, and release each once.

        Empties ``batches``.  A failure is latched; later batches are released
        without being submitted (given up and released at once when the
        sink's submit raised past Exception and the loop dies).  Records
        never handed on because of a failure (the sink's submit raised, or
        one was latched before) are counted as given up at ingress
        (``taproute_ingress_given_up_records``): ``submit()`` had accepted them;
        of a batch a routing sink's submit took in part before it failed
        (:class:`BatchCutShort`), only the records no route took.
        """
        handed = list(batches)
        batches.clear()
        if len(handed) > 1:
            assert self._arena is not None
            try:
                handed, merged = merge(handed, self._arena)
            except Exception:  # nothing taken over: each goes on alone, as without an arena
                merged = 0
            self._ingress.counters.merged += merged
        for position, batch in enumerate(handed):
            try:
                # An empty batch only comes for its release: nothing to route.
                if len(batch):
                    if self._latch.failure is not None:
                        self._ingress.counters.given_up += len(batch)
                    else:
                        self._sink_call = "submit"
                        await self._submit(batch)
            except Exception as exc:
                # The sink refused the batch (a routing sink raises what it
                # latched before it takes any of it): none of it is routed;
                # or it took a part, and says how much it did not.
                untaken = exc.untaken if isinstance(exc, BatchCutShort) else len(batch)
                self._ingress.counters.given_up += untaken
                self._ingress.fail(self._latch.latch(exc, where="record sink submit"))
            except trio.Cancelled:  # the grace ran out: this one and the rest are given up
                if not isinstance(self.record_sink, CutsShort):  # (else counted where it was)
                    self._sink_abandoned[0] += len(batch)
                    self._sink_abandoned[1] += 1
                gone = SinkClosed("runtime stopped: the shutdown grace ran out")
                self._give_up(list(handed[position + 1 :]), gone, count="abandoned")
                raise
            except BaseException as exc:  # the loop dies: this one and the rest given up
                self._ingress.counters.given_up += len(batch)
                failure = self._latch.latch(_loop_error(exc), where="record sink submit")
                self._give_up(list(handed[position + 1 :]), failure, count="given_up")
                raise
            finally:
                self._sink_call = None
                batch.lease.release()

    def _closed_reason(self) -> str | None:
        return "runtime is closed" if self._ingress.closed else None

    def stop(self, timeout: float | None = None) -> None:
        """Same as :meth:`close` (the service-object spelling)."""
        self.close(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Drain, flush and close the sink, stop the loop and join its thread,
        within a grace: ``timeout`` seconds, or :attr:`shutdown_grace` (30 s
        by default); ``math.inf`` waits as long as it takes.

        Raises the latched failure, if any.  Within the grace everything is
        drained, flushed and closed as usual.  When it runs out first:

        - shortly before its end (a quarter of it, at most 5 s), every
          destination of a routing sink still busy is cut off: its call under
          way is cancelled (a call in a worker thread is abandoned if it runs
          with ``abandon_on_cancel``), its background task too (a writer
          process is killed), and what was queued for it, or still comes, is
          given back and counted as abandoned
          (``taproute_destination_abandoned_records``); the other
          destinations are then flushed and closed as usual;
        - at its end, whatever still runs on the loop is cancelled, and what
          was still in ingress or in routes is given back and counted;
        - the loop thread ends, and :class:`ShutdownAbandoned` (a
          ``TimeoutError``) names the destinations that were busy and what
          was given up, per destination.

        A sink (or processor) that blocks the loop thread itself, or waits in
        a worker thread that does not let itself be abandoned, cannot be
        interrupted: ``close`` then returns about 2 s past the grace with
        ``ShutdownAbandoned(loop_ended=False)``, and the thread, a daemon,
        runs on with what it holds until that call returns.

        Idempotent: a later ``close()`` returns at once after a clean close,
        and after one whose grace ran out waits (within its own grace) for a
        loop thread still blocked, then raises the same ``ShutdownAbandoned``.
        """
        if self._thread is None:
            return
        # A timeout that is not seconds ("1", NaN) is refused as flush's is,
        # not converted (float("1")) or taken as no grace (max(0, nan)).
        grace = self.shutdown_grace if timeout is None else max(0.0, check_grace_timeout(timeout))
        self._ingress.refuse_on_loop("close()")
        if self._shutdown_error is not None:
            self._thread.join(thread_wait(grace))
            raise self._shutdown_error
        started = time.monotonic()
        future = self._ingress.put_control("close")
        bounded = thread_wait(grace) is not None
        if bounded:
            self._start_grace(started, grace)
        deadline = started + grace + LOOP_END_S if bounded else None
        failure: BaseException | None = None
        try:
            future.result(None if deadline is None else deadline - time.monotonic())
        except TimeoutError:
            pass  # the loop thread did not answer: said below
        except Exception as exc:
            failure = exc
        self._thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        loop_ended = not self._thread.is_alive()
        if self._busy or self._busy_routes or self._stopped_short or not loop_ended:
            raise self._abandoned(grace, loop_ended)
        if failure is not None:
            raise failure
        self._latch.raise_if_failed()

    def _start_grace(self, started: float, grace: float) -> None:
        """Have the loop keep the grace (once; a later close keeps the first)."""
        if self._grace_started.is_set() or self._cut_at != math.inf:
            return
        self._cut_at = started + grace - min(CUT_RESERVE_S, grace / 4)
        self._stop_at = started + grace
        if self._token is None:
            return  # the loop never ran
        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(self._grace_started.set)

    def _abandoned(self, grace: float, loop_ended: bool) -> ShutdownAbandoned:
        """The error of a close whose grace ran out (made once, then kept)."""
        with self._shutdown_lock:
            if self._shutdown_error is not None:
                return self._shutdown_error
            busy = dict(self._busy)
            if not loop_ended and not busy:  # the loop is blocked: read, not cut
                if isinstance(self.record_sink, CutsShort):
                    busy = self.record_sink.busy()
                elif self._sink_call is not None:
                    busy = {"record sink": self._sink_call}
            snap = self._snapshot_in_loop()
            records = {  # what never got there, and what the sink took and gave up
                n: d.abandoned_records + d.given_up_records for n, d in snap.destinations.items()
            }
            batches = {n: d.abandoned_batches for n, d in snap.destinations.items()}
            if self._sink_abandoned[0]:
                records["record sink"], batches["record sink"] = self._sink_abandoned
            error = ShutdownAbandoned(
                grace,
                busy=busy,
                abandoned_records={n: r for n, r in records.items() if r},
                abandoned_batches={n: b for n, b in batches.items() if b},
                busy_routes=self._busy_routes,
                route_records=sum(r.abandoned for r in snap.routes.values()),
                ingress_records=snap.ingress.abandoned,
                loop_ended=loop_ended,
                failure=self._latch.failure,
            )
            if loop_ended:
                self._latch.latch(error, where="shutdown")
            self._shutdown_error = error
            return error

    # -- observation -------------------------------------------------------

    def snapshot(self) -> ServiceSnapshot:
        """Ingress counters plus the record sink's (when it keeps any); any thread."""
        loop_running = self._thread is not None and self._thread.is_alive()
        if not loop_running or threading.current_thread() is self._thread:
            return self._snapshot_in_loop()
        try:
            return trio.from_thread.run_sync(self._snapshot_in_loop, trio_token=self._token)
        except trio.RunFinishedError:
            return self._snapshot_in_loop()

    def _ingress_snapshot(self) -> IngressCounters:
        counters = self._ingress.snapshot()  # a copy of its own
        counters.queued_reloads = len(self._queued_swaps)
        return counters

    def _snapshot_in_loop(self) -> ServiceSnapshot:
        observable = self._observable
        sink = (
            RouterSnapshot(routes={}, destinations={}, unmatched_forwarded=0, unmatched_dropped=0)
            if observable is None
            else observable.snapshot()
        )
        failure = self._latch.failure or (
            None if self._reports_failure is None else self._reports_failure.failure
        )
        return ServiceSnapshot(
            routes=sink.routes,
            destinations=sink.destinations,
            unmatched_forwarded=sink.unmatched_forwarded,
            unmatched_dropped=sink.unmatched_dropped,
            failure=None if failure is None else str(failure),
            causal=sink.causal,
            unmatched_samples=sink.unmatched_samples,
            generation=sink.generation,
            ingress=self._ingress_snapshot(),
            reloads=self.reload_ledger.snapshot(),
            stores={
                **sink.stores,
                **{s.name: s for s in (store.store_status() for store in self._stores)},
            },
        )


__all__ = ["LoopTask", "RecordRuntime"]
