"""Several calls of one route's processor in one trip to a worker thread.

A stateful owner with a backlog takes the queued batches together: one hop
to a worker thread makes their calls one after another, in order, and stops
after the first that fails, so no call ever runs on state a failed call left
behind (the owner puts that call's slots back before anything else runs).
Each call is judged as :func:`~taproute.actors.attempt.call_processor`
judges one (an exception, ``Failed``, an output that does not match its
layout), and each has the route's whole deadline from its own start: past
it, the calls made so far stand, the running one is given up as timed out
(its thread cannot be stopped; it makes no further call) and the rest are
not made.

A hop costs more CPU than the loop's share of a small call (the thread's
wake-up, the result's trip back, the limiter, a cancel scope): taken once
for several batches it is paid once.
"""

from __future__ import annotations

import math
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import trio

from taproute.actors.attempt import CallingFor, Outcome, Placement, judged, prepared_call
from taproute.routing.batch import RecordBatch
from taproute.routing.failures import FailureCode, classify
from taproute.routing.plan import PlannedRoute
from taproute.routing.records import Records

#: The most calls one hop makes (the calls' buffers stay held until it returns).
MAX_CALLS = 16


@attrs.frozen
class Call:
    """One processor call of a hop: its batch, the processor's further
    arguments, and what runs just before it (``call_processor``'s ``prepare``)."""

    batch: RecordBatch
    args: tuple[Any, ...]
    prepare: Callable[[], object] | None = None


class _Hop:
    """What the worker thread and the loop share about one hop's calls."""

    def __init__(self, planned: PlannedRoute, calls: Sequence[Call], hook_name: Any) -> None:
        self.planned = planned
        self.calls = calls
        self.hook_name = hook_name
        self.clock = trio.lowlevel.current_clock()
        self.token = trio.lowlevel.current_trio_token()
        self.lock = threading.Lock()
        #: Calls started, the start (Trio clock) of the last, and what each
        #: finished call came to with the seconds it was charged.
        self.started = 0
        self.started_at = self.clock.current_time()
        self.finished: list[tuple[Outcome, float]] = []
        #: Set by the loop: make no further call.
        self.stop = False

    def run(self) -> None:
        """The calls, in order, until one fails or the loop says stop (worker thread)."""
        planned = self.planned
        assert planned.processor is not None
        fn, layout = planned.processor.fn, planned.input_layout
        for call in self.calls:
            with self.lock:
                if self.stop:
                    return
                self.started += 1
                self.started_at = self.clock.current_time()
            records = Records(call.batch, layout, self.hook_name) if layout else call.batch
            try:
                with CallingFor(self.token):
                    result, elapsed = prepared_call(call.prepare, fn, records, *call.args)
            except Exception as exc:
                code = classify(exc)
                tb = None if code is FailureCode.HANDLER_INVALID else traceback.format_exc()
                done = Outcome(code=code, error=exc, traceback=tb), math.inf
            else:
                done = judged(planned, result), elapsed
            with self.lock:
                self.finished.append(done)
            if done[0].code is not None:
                return


async def call_processor_in_one_hop(
    planned: PlannedRoute,
    calls: Sequence[Call],
    *,
    limiter: trio.CapacityLimiter,
    threads: trio.CapacityLimiter,
    hook_name: Any = None,
    abandoned: Callable[[int], None] | None = None,
    placement: Placement,
) -> list[Outcome]:
    """Make ``calls`` in one worker thread, in order; return the outcomes of
    the calls made: all succeeded but the last, which may have failed (a
    timeout included); the calls after them were not made.

    For processors that may run in any worker thread (not ``needs_thread``:
    the thread is not a ``trio.to_thread`` one).  The batches' buffers stay
    held until the thread returns, even past a timeout (``abandoned`` counts
    those); ``limiter`` is held for the hop, ``threads`` counts its thread.
    """
    assert planned.processor is not None and not planned.processor.needs_thread
    deadline = planned.route.failure_policy.deadline or math.inf
    hop = _Hop(planned, calls, hook_name)
    # Taken once the thread has its slot (no checkpoint until it starts): a
    # hop cancelled while it waited for one (a shutdown's grace ran out)
    # never runs, and holds taken before would never be let go.
    holds: list[Any] = []
    token = trio.lowlevel.current_trio_token()
    returned = trio.Event()
    left = False

    def let_go() -> None:  # on the loop once the thread returned; never raises
        threads.release_on_behalf_of(hop)
        for hold in holds:
            hold.release()
        if left and abandoned is not None:
            abandoned(-1)
        returned.set()

    def deliver(_: object) -> None:  # in the thread, after run()
        try:
            token.run_sync_soon(let_go)
        except trio.RunFinishedError:
            for hold in holds:
                hold.release()

    async with limiter:
        await threads.acquire_on_behalf_of(hop)
        holds.extend(call.batch.retain() for call in calls)
        try:
            trio.lowlevel.start_thread_soon(hop.run, deliver)
        except BaseException:
            threads.release_on_behalf_of(hop)
            for hold in holds:
                hold.release()
            raise
        try:
            while not returned.is_set():
                with trio.move_on_at(hop.started_at + deadline):
                    await returned.wait()
                if returned.is_set():
                    break
                with hop.lock:
                    if hop.clock.current_time() >= hop.started_at + deadline:
                        hop.stop = True
                        break
        finally:
            if not returned.is_set():
                with hop.lock:
                    hop.stop = True
                left = True
                if abandoned is not None:
                    abandoned(1)
    with hop.lock:
        outcomes = [outcome for outcome, _ in hop.finished]
        charged = [elapsed for _, elapsed in hop.finished]
        running = hop.started > len(hop.finished)
    if running:  # timed out
        outcomes.append(
            Outcome(
                code=FailureCode.HANDLER_TIMEOUT,
                error=TimeoutError(f"no result within the route's {deadline:g} s deadline"),
            )
        )
        charged.append(math.inf)
    for elapsed in charged:
        placement.took(elapsed)
    return outcomes
