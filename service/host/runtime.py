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
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Self

import trio

from taproute.actors.counters import Observable, RouterSnapshot
from taproute.actors.destination import is_sink
from taproute.actors.fairness import scheduled_now
from taproute.routing.batch import RecordBatch
from taproute.routing.hooks import HookRegistry
from taproute.routing.intake import Intake
from taproute.routing.keys import KeyAction
from taproute.routing.limits import COALESCE_RECORDS, QUEUE_BYTES, QUEUE_RECORDS
from taproute.routing.producer import Producer
from taproute.routing.schema import RecordSchema
from taproute.routing.sink import (
    BoundsBlocking,
    DescribesRecords,
    EndsKeys,
    NamesHooks,
    RecordSink,
    Reloads,
    ReportsFailure,
    RunsInBackground,
    TakesCheckedBatches,
)
from taproute.service.host.batch_merge import SpansPayloads, merge, mergeable
from taproute.service.host.closing import ClosesOnExit
from taproute.service.host.counters import ServiceSnapshot
from taproute.service.host.ingress import WAKE_DELAY_S, Ingress, WhenFull, thread_wait
from taproute.service.host.ingress_control import Control
from taproute.service.host.producer_calls import ProducerCalls
from taproute.service.host.sink_controls import SinkControls

#: Something else to host on the runtime's loop: started with ``nursery.start``
#: before the runtime reports itself running, cancelled once the sink is closed.
LoopTask = Callable[..., Awaitable[object]]


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
        if max_block is not None and not max_block >= 0:
            raise ValueError(f"max_block must be seconds >= 0 or None, got {max_block!r}")
        if not (wake_delay >= 0 and math.isfinite(wake_delay)):
            raise ValueError(f"wake_delay must be finite seconds >= 0, got {wake_delay!r}")
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
            error = exc if isinstance(exc, Exception) else RuntimeError(f"loop stopped: {exc!r}")
            if not self._ready.is_set():
                self._start_error = error
            failure = self._latch.latch(error, where="runtime loop")
            for item in self._ingress.fail(failure, loop_gone=True):
                if isinstance(item, Control) and not item.future.done():
                    item.future.set_exception(failure)
        finally:
            self._ready.set()

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._wakeup = trio.Event()
        self._ingress.connect(self._schedule_wake)
        async with trio.open_nursery() as nursery:
            if self._background is not None:
                await nursery.start(self._background.run)
            for task in self._loop_tasks:
                await nursery.start(task)
            self._ready.set()
            await self._record_worker()
            nursery.cancel_scope.cancel()  # the sink is closed; stop the loop tasks

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
            records = nbytes = 0
            run: list[RecordBatch] = []  # batches to merge, in queue order
            try:
                for item in items:
                    if isinstance(item, RecordBatch):
                        records += len(item)
                        nbytes += item.payload.nbytes
                        if self._arena is not None and mergeable(item):
                            run.append(item)
                            continue
                    if run:
                        await self._hand_on(run)
                    if isinstance(item, Control):
                        if await self._control(item):
                            return
                    else:
                        await self._hand_on([item])
                if run:
                    await self._hand_on(run)
            finally:
                self._ingress.done(records, nbytes)

    async def _hand_on(self, batches: list[RecordBatch]) -> None:
        """Submit ``batches`` (taken in this order) to the record sink, merged
        into one when the arena spans their payloads, and release each once.

        Empties ``batches``.  A failure is latched; later batches are released
        without being submitted.
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
        for batch in handed:
            try:
                # An empty batch only comes for its release: nothing to route.
                if self._latch.failure is None and len(batch):
                    await self._submit(batch)
            except Exception as exc:
                self._ingress.fail(self._latch.latch(exc, where="record sink submit"))
            finally:
                batch.lease.release()

    def _closed_reason(self) -> str | None:
        return "runtime is closed" if self._ingress.closed else None

    def stop(self, timeout: float | None = None) -> None:
        """Same as :meth:`close` (the service-object spelling)."""
        self.close(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Drain, flush and close the sink, stop the loop and join its thread.

        Idempotent.  Raises the latched failure, if any.  ``timeout`` bounds
        the whole call (the close and joining the thread); past it a
        TimeoutError says so, the close goes on in the loop thread, and a
        later ``close()`` waits for it (it too raises TimeoutError until the
        thread has ended).
        """
        if self._thread is None:
            return
        self._ingress.refuse_on_loop("close()")
        timeout = thread_wait(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        future = self._ingress.put_control("close")
        try:
            future.result(timeout)
        except TimeoutError:
            raise self._close_timed_out(timeout) from None
        finally:
            self._thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            raise self._close_timed_out(timeout)
        self._latch.raise_if_failed()

    @staticmethod
    def _close_timed_out(timeout: float | None) -> TimeoutError:
        return TimeoutError(
            f"close: not done within {timeout} s; the record sink is still draining, "
            "flushing or closing (a destination's call has not returned) and the loop "
            "thread runs on: call close again to wait for it"
        )

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
            ingress=self._ingress.snapshot(),
        )


__all__ = ["LoopTask", "RecordRuntime"]
