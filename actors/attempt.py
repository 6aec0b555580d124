"""One try at processing records: what is being tried, and how a processor call ends.

:class:`Attempt` carries records through a route with their failure history;
:func:`call_processor` runs a route's processor once, in a worker thread
under the route's deadline, and classifies what came back as an
:class:`Outcome` (rows, or a :class:`~taproute.routing.failures.FailureCode`).
"""

from __future__ import annotations

import math
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import trio

from taproute.actors.fairness import yield_if_due
from taproute.routing.batch import RecordBatch, Retained
from taproute.routing.errors import OutputLayoutMismatch
from taproute.routing.failures import Failed, FailureCode, ProcessorFailed, classify
from taproute.routing.parking import ParkIds
from taproute.routing.plan import PlannedRoute
from taproute.routing.records import Records
from taproute.routing.validation import check_rows

try:
    import resource
except ImportError:  # not a Unix
    resource = None  # type: ignore[assignment]

#: ``getrusage``'s per-thread figures (Linux); elsewhere calls are judged by wall time.
_THREAD_USAGE: int | None = getattr(resource, "RUSAGE_THREAD", None)

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
    #: Its retry budget is spent: one record of a unit whose retries ran out,
    #: run once more on its own (:meth:`last_tries`).  Its next failure gives
    #: it up, whatever the code: no new retry budget.
    spent: bool = False
    scheduled: bool = False  # parked with a retry due (the head of its key, if stateful)
    hold: Retained | None = None
    #: Per record, its id in the park store once it was parked there (None: not parked).
    park_ids: ParkIds | None = None
    #: A failed call the record worker made itself, queued for a pool worker to
    #: handle by the route's failure policy (None: the attempt is still to be made).
    pending: Outcome | None = None
    #: Records of this attempt (and of its parts) settled so far by the task
    #: handling it (processed, dead-lettered, dropped, or parked), shared with
    #: its parts: when an unexpected failure cuts that task short, the rest
    #: are counted given up (None: nobody counts).
    tally: list[int] | None = None

    def note_settled(self, records: int) -> None:
        """``records`` of this attempt reached a counted state (see :attr:`tally`)."""
        if self.tally is not None:
            self.tally[0] += records

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
            pending=None,
            park_ids=None if self.park_ids is None else self.park_ids[selection],
        )

    def afresh(self) -> Attempt:
        """These records as an attempt of their own, with no history but their
        park ids: a part of a failed call whose failure may not be theirs."""
        return Attempt(self.batch, self.keys, park_ids=self.park_ids, tally=self.tally)

    def last_tries(self) -> list[Attempt]:
        """One attempt per record, in order, each with this attempt's history,
        marked isolated and :attr:`spent`: a unit whose retries ran out, re-run
        record by record once each, with no retry budget of their own."""
        return [
            attrs.evolve(self.part(np.array([i], dtype=np.intp)), isolated=True, spent=True)
            for i in range(len(self.batch))
        ]

    def singles(self) -> list[Attempt]:
        """One fresh attempt per record, in order, marked isolated (no history but
        its park id)."""
        keys, ids = self.keys, self.park_ids
        return [
            Attempt(
                self.batch.select(np.array([i])),
                None if keys is None else keys[i : i + 1],
                isolated=True,
                park_ids=None if ids is None else ids[i : i + 1],
                tally=self.tally,
            )
            for i in range(len(self.batch))
        ]


@attrs.frozen
class Outcome:
    """How one processor call ended: rows (or None: nothing to emit), or a failure."""

    rows: npt.NDArray[np.void] | None = None
    code: FailureCode | None = None
    error: BaseException | None = None
    traceback: str | None = None


_calling = threading.local()


def calling_loop() -> trio.lowlevel.TrioToken | None:
    """The Trio loop whose processor or predicate this worker thread is
    running now, if any: a flush, close or blocking submit of that loop's
    runtime from inside the call would wait for the call itself."""
    token: trio.lowlevel.TrioToken | None = getattr(_calling, "token", None)
    return token


class CallingFor:
    """While entered (in a worker thread): this thread runs a call for the
    loop of ``token`` (see :func:`calling_loop`)."""

    __slots__ = ("_before", "_token")

    def __init__(self, token: trio.lowlevel.TrioToken) -> None:
        self._token = token
        self._before: trio.lowlevel.TrioToken | None = None

    def __enter__(self) -> None:
        self._before = getattr(_calling, "token", None)
        _calling.token = self._token

    def __exit__(self, *exc: object) -> None:
        _calling.token = self._before


class _NotesStart:
    """A thread limiter (what ``trio.to_thread.run_sync`` takes) that tells a
    :class:`HeldWhileRunning` when its call got a slot: Trio starts the
    thread right after, with no checkpoint between."""

    def __init__(self, threads: trio.CapacityLimiter, held: HeldWhileRunning) -> None:
        self._threads = threads
        self._held = held

    async def acquire_on_behalf_of(self, borrower: object) -> None:
        await self._threads.acquire_on_behalf_of(borrower)
        self._held._started()

    def release_on_behalf_of(self, borrower: object) -> None:
        self._threads.release_on_behalf_of(borrower)


class HeldWhileRunning:
    """Holds a batch's buffer while a worker thread reads it, even past the call.

    A call abandoned at its deadline (or by cancellation) keeps running in
    its thread; the buffer is then let go when that thread returns, on the
    Trio loop (in the thread itself once the loop is gone), and never
    before.  ``abandoned(+1/-1)`` is told when such a hold starts and ends.
    """

    def __init__(self, batch: RecordBatch, abandoned: Callable[[int], None] | None) -> None:
        self._hold = batch.retain()
        self._abandoned = abandoned
        self._lock = threading.Lock()
        self._returned = False
        self._left = False
        self._will_run = False  # its thread got a slot: it runs :meth:`run`
        self._token = trio.lowlevel.current_trio_token()

    def limiter(self, threads: trio.CapacityLimiter) -> trio.CapacityLimiter:
        """``threads`` for the ``to_thread.run_sync`` of this hold's call,
        noting when the call gets its slot: from then its thread runs
        :meth:`run`.  A call cancelled while it waited for a slot (a shutdown's
        grace ran out) never runs, so :meth:`leave` lets go at once: waiting
        for a thread that never starts kept the buffer, and its release
        callback never ran."""
        return _NotesStart(threads, self)  # type: ignore[return-value]  # duck-typed limiter

    def _started(self) -> None:
        with self._lock:
            self._will_run = True

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Call ``fn(*args)`` (in the worker thread); then let go if the caller left."""
        try:
            with CallingFor(self._token):
                return fn(*args)
        finally:
            with self._lock:
                self._returned = True
                left = self._left
            if left:
                try:
                    self._token.run_sync_soon(self._let_go_late)
                except trio.RunFinishedError:
                    self._let_go_late()

    def leave(self) -> None:
        """The caller is done waiting (on the loop): let go now if the thread
        returned, else when it does."""
        with self._lock:
            self._left = True
            returned = self._returned
            will_run = self._will_run
        if returned or not will_run:  # done, or never to run: nothing reads it
            self._hold.release()
        elif self._abandoned is not None:
            self._abandoned(1)

    def _let_go_late(self) -> None:
        self._hold.release()
        if self._abandoned is not None:
            self._abandoned(-1)


#: A processor call that returns within this many seconds costs less than its
#: trip to a worker thread and back (0.1 to 0.4 ms of CPU over the two threads
#: on a loaded 2-core machine, more while the worker waits for the GIL; see
#: bench/profiles/).  At 0.2 ms a 0.1 ms call preempted twice in a row on a
#: busy machine went back to threads for 8 calls or more: a sixth of a
#: 2-route chain's calls took the hop, a quarter of the loop's time.
INLINE_BELOW_S = 0.0005
#: An inline call that takes this long goes back to worker threads at once
#: (it waited: I/O, a lock, a sleep; or it has grown), unless the processor
#: has earned trust (below); a call between the two bounds is forgiven once,
#: since a busy machine preempts quick calls too.
INLINE_WALL_S = 0.002
#: How many quick calls in a row move a route's processor onto the loop (at
#: first: see :data:`INLINE_AFTER_MAX`).
INLINE_AFTER = 8
#: Each time a processor is sent back to worker threads from the loop, the
#: quick calls it needs to come back double, up to this many; they halve
#: again after every :data:`INLINE_TRUSTED` quick calls in a row on the loop.
#: A thread call that waited briefly is charged its CPU time (see
#: :data:`THREAD_WAIT_S`), so a processor that does wait a little (I/O, a
#: lock) is caught on the loop instead, where a wait counts in full: the
#: doubling makes that rarer each time.
INLINE_AFTER_MAX = 512
#: After this many quick calls in a row (the last INLINE_TRUSTED -
#: INLINE_AFTER of them on the loop), one call of any length short of a
#: failure is forgiven too: a loaded machine deschedules the loop thread for
#: several milliseconds in the middle of a quick call, and each such wrong
#: verdict cost the next INLINE_AFTER calls a thread hop each.  The trust is
#: spent by it (earned again by as many quick calls), so a processor that
#: really waits or has grown leaves at its next slow call, and at most one
#: call in INLINE_TRUSTED - INLINE_AFTER runs long on the loop.
INLINE_TRUSTED = 64
#: A call in a worker thread whose wall time stays under this is charged its
#: CPU time even when its thread waited (a voluntary context switch).  A
#: worker thread waits for the GIL whenever the loop or a producer holds it
#: (up to the interpreter's switch interval, 5 ms, per wait), which looks
#: like any other wait; judged by wall time, a quick processor sent back to
#: threads under load could not come back while the load lasted, each
#: thread call slower than the loop call it replaced (the latency bench's
#: stateless route at 80% of capacity: backlogs of 20 to 100 ms).  A call
#: that waits longer stays in threads; one that waits less is judged on the
#: loop if it gets there.
THREAD_WAIT_S = 0.01


class Placement:
    """Where one route's processor runs: in a worker thread (the default), or
    on the Trio loop itself once its last :data:`INLINE_AFTER` calls each
    returned within :data:`INLINE_BELOW_S`.  It goes back to worker threads
    at a call of :data:`INLINE_WALL_S` or more, at two slower calls in a row,
    or at a call that raised or ran past the deadline.

    An inline call skips the thread hop, which for a small processor costs
    several times the call.  It cannot be abandoned at the route's deadline
    (nothing interrupts a running call); a processor only gets there by being
    quick, and leaves at its first long call (its second, once it has been
    quick :data:`INLINE_TRUSTED` times in a row).  A processor registered
    with ``needs_thread=True`` never runs inline.  Calls are timed by the
    wall clock (``perf_counter``); one that ran past :data:`INLINE_BELOW_S`
    without waiting for anything is charged its CPU time instead
    (:func:`charged`: its thread was preempted, which says nothing of the
    processor).
    """

    __slots__ = ("after", "clean", "quick", "slow")

    def __init__(self) -> None:
        #: Consecutive quick calls (counted up to ``after``).
        self.quick = 0
        #: Consecutive calls that were not quick.
        self.slow = 0
        #: Quick calls in a row that move the processor onto the loop.
        self.after = INLINE_AFTER
        #: Consecutive quick calls on the loop since the last slow one (or
        #: the last forgiven one: forgiving spends the trust they earned).
        self.clean = 0

    @property
    def inline(self) -> bool:
        """True when the next call may run on the loop."""
        return self.quick >= self.after

    def took(self, seconds: float) -> None:
        """Note how long a call ran (``math.inf``: it raised or was abandoned)."""
        was_inline = self.inline
        if seconds < INLINE_BELOW_S:
            self.quick = min(self.quick + 1, self.after)
            self.slow = 0
            if was_inline:
                self.clean += 1
                if self.clean % INLINE_TRUSTED == 0 and self.after > INLINE_AFTER:
                    self.after //= 2  # it has behaved on the loop: forgive half
                    self.quick = self.after
            return
        self.slow += 1
        long = seconds >= INLINE_WALL_S
        trusted = self.clean >= INLINE_TRUSTED - INLINE_AFTER
        if not was_inline or self.slow >= 2 or seconds == math.inf or (long and not trusted):
            self.quick = self.clean = 0
            if was_inline:  # sent back from the loop: it takes longer to return
                self.after = min(2 * self.after, INLINE_AFTER_MAX)
        elif long:
            self.clean = 0  # forgiven once: the trust is spent


def runs_inline(planned: PlannedRoute, placement: Placement) -> bool:
    """True when :func:`call_processor` would run ``planned``'s processor on the
    loop now (it is quick, and not registered ``needs_thread``)."""
    processor = planned.processor
    return placement.inline and processor is not None and not processor.needs_thread


def timed_call(fn: Callable[..., Any], *args: Any, in_thread: bool = False) -> tuple[Any, float]:
    """``fn(*args)``, and the seconds it took (in its thread) as
    :class:`Placement` judges a call: its wall time, unless it ran past
    :data:`INLINE_BELOW_S` without waiting for anything, or (``in_thread``:
    a worker thread) waited less than :data:`THREAD_WAIT_S` in all (see
    :func:`charged`)."""
    usage = _thread_usage() if _THREAD_USAGE is not None else None
    started = time.perf_counter()
    result = fn(*args)
    elapsed = time.perf_counter() - started
    if usage is not None and elapsed >= INLINE_BELOW_S:
        elapsed = charged(elapsed, usage, _thread_usage(), in_thread=in_thread)
    return result, elapsed


def timed_call_in_thread(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    """:func:`timed_call` for a call made in a worker thread."""
    return timed_call(fn, *args, in_thread=True)


def prepared_call(
    prepare: Callable[[], object] | None,
    fn: Callable[..., Any],
    *args: Any,
    in_thread: bool = False,
) -> tuple[Any, float]:
    """``prepare()`` (untimed), then :func:`timed_call` of ``fn(*args)``: both in
    the calling thread, so one thread hop carries them."""
    if prepare is not None:
        prepare()
    return timed_call(fn, *args, in_thread=in_thread)


def prepared_call_in_thread(
    prepare: Callable[[], object] | None, fn: Callable[..., Any], *args: Any
) -> tuple[Any, float]:
    """:func:`prepared_call` for a call made in a worker thread."""
    return prepared_call(prepare, fn, *args, in_thread=True)


def charged(wall: float, before: Any, after: Any, *, in_thread: bool = False) -> float:
    """The seconds a call is charged, from the thread's ``getrusage`` before
    and after it: its wall time if the thread waited during it (a voluntary
    context switch: I/O, a lock, a sleep, the GIL), else its CPU time; in a
    worker thread (``in_thread``), its CPU time also when it waited but
    returned within :data:`THREAD_WAIT_S` (its waits may have been the GIL's).

    A thread that only lost its core meanwhile (preempted: involuntary
    switches only) would have run the call in its CPU time; on a loaded
    2-core machine such calls measured 0.5 to 37 ms of wall time for 0.05 to
    0.3 ms of CPU, each sending a quick processor back to worker threads for
    :data:`INLINE_AFTER` calls (bench/profiles/latency80_stateless_*)."""
    cpu: float = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if after.ru_nvcsw > before.ru_nvcsw and not (in_thread and wall < THREAD_WAIT_S):
        return wall
    return min(wall, cpu)


def _thread_usage() -> Any:
    assert _THREAD_USAGE is not None
    return resource.getrusage(_THREAD_USAGE)


async def call_processor(
    planned: PlannedRoute,
    batch: RecordBatch,
    *args: Any,
    limiter: trio.CapacityLimiter,
    threads: trio.CapacityLimiter,
    hook_name: Callable[[int], str] | None = None,
    abandoned: Callable[[int], None] | None = None,
    placement: Placement | None = None,
    prepare: Callable[[], object] | None = None,
    thread_waits_by_cpu: bool = True,
) -> Outcome:
    """Run ``planned``'s processor on ``batch`` under the route's deadline.

    ``limiter`` bounds concurrent calls; ``threads`` only counts worker
    threads (one past its deadline is abandoned and must not keep a slot).
    The batch's buffer stays held until the processor returns, even when
    the call was given up at its deadline (``abandoned`` counts those).
    With a ``placement``, a processor that has been quick runs on the loop
    instead (see :class:`Placement`).  ``prepare`` runs just before the
    processor, where it runs (in its worker thread, or on the loop), and is
    not timed; if it raises, the processor is not called and the call fails
    like a processor that raised.  ``thread_waits_by_cpu``: a call in a
    worker thread that waited briefly is charged its CPU time (see
    :data:`THREAD_WAIT_S`); False charges it its wall time, as on the loop.
    """
    if planned.processor is None:
        return Outcome(code=FailureCode.HANDLER_MISSING, error=LookupError("no processor"))
    fn = planned.processor.fn
    deadline = planned.route.failure_policy.deadline or math.inf
    layout = planned.input_layout
    records = Records(batch, layout, hook_name) if layout else batch
    place = placement if placement is not None else Placement()
    elapsed = math.inf  # until the call returned
    try:
        if runs_inline(planned, place):
            result, elapsed = prepared_call(prepare, fn, records, *args)
            # A schedule point, as a thread hop would be (shielded: a cancellation
            # cannot lose a result already computed), unless the task has just
            # passed one (the record worker, woken for this batch: fairness.py).
            await yield_if_due()
        else:
            async with limiter:
                held = HeldWhileRunning(batch, abandoned)
                try:
                    with trio.move_on_after(deadline) as scope:
                        result, elapsed = await trio.to_thread.run_sync(
                            held.run,
                            prepared_call_in_thread if thread_waits_by_cpu else prepared_call,
                            prepare,
                            fn,
                            records,
                            *args,
                            limiter=held.limiter(threads),
                            abandon_on_cancel=True,
                        )
                finally:
                    held.leave()
            if scope.cancelled_caught:
                return Outcome(
                    code=FailureCode.HANDLER_TIMEOUT,
                    error=TimeoutError(f"no result within the route's {deadline:g} s deadline"),
                )
    except Exception as exc:
        code = classify(exc)
        tb = None if code is FailureCode.HANDLER_INVALID else traceback.format_exc()
        return Outcome(code=code, error=exc, traceback=tb)
    finally:
        place.took(elapsed)
    return judged(planned, result)


def judged(planned: PlannedRoute, result: Any) -> Outcome:
    """What a processor's return value comes to: rows checked against the
    output layout, nothing to emit, or a failure (``Failed``, a mismatch)."""
    if isinstance(result, Failed):
        return Outcome(code=FailureCode.HANDLER_FAILED, error=ProcessorFailed(result.reason))
    if result is None:
        return Outcome()
    assert planned.output_layout is not None and planned.processor is not None
    try:
        rows = check_rows(
            result, planned.output_layout, route=planned.name, processor=planned.processor.name
        )
    except OutputLayoutMismatch as exc:
        return Outcome(code=FailureCode.HANDLER_INVALID, error=exc)
    except Exception as exc:  # the check itself raised on what came back: still a bad output
        error = OutputLayoutMismatch(
            f"route {planned.name!r}, processor {planned.processor.name!r}, output layout "
            f"{planned.output_layout.name!r}: the output could not be checked: "
            f"{type(exc).__name__}: {exc}"
        )
        error.__cause__ = exc
        return Outcome(code=FailureCode.HANDLER_INVALID, error=error)
    return Outcome(rows=rows)
