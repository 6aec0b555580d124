"""The thread-safe ingress between producer threads and the Trio loop.

Producers append batches (or single records, which are coalesced into one
batch) to a deque under a lock only producers take; the record worker on the
loop thread takes everything queued at once without that lock (a deque's
``append`` and ``popleft`` are atomic) and gives capacity back through its
own counter.  So a model thread in a capture hook never waits for the loop
thread to leave a critical section: on a busy 2-core machine the loop thread
can lose its core while holding a shared lock, and every hook then waits a
scheduler slice for it.

Capture hooks (``defer_wake``) do not wake the loop themselves: a wake-up
costs the model thread a socket write and, worse, hands the GIL to the loop
thread in the middle of the forward pass.  The record worker polls every
``wake_delay`` while batches arrive and takes what the hooks queued; once its
polls found nothing for ``park_after`` it parks (no timer), and the next
batch wakes it once.
Ingress half full, a producer about to block, a plain ``submit_batch``, a
flush or a close wake it at once.  Capacity is counted in records and bytes
until the record worker has handed a batch on, so a blocked record worker
fills ingress, and full ingress blocks (or refuses) the producer.
A key control (complete, cancel, reopen) takes one record's room until the
record worker ran it, and waits for room (or is refused, or shed past a
capture block's ``max_block``) as a record does: a producer ending keys in a
loop against a stalled router cannot grow ingress without bound.
So does a flush or reload control (a close takes none: there is only ever
one), waiting for room within its caller's timeout; a flush that finds the
last control queued a flush of its kind, with nothing queued after it, shares
that control instead: repeated ``flush(timeout=...)`` calls against a stalled
router leave one control behind, not one each.
"""

from __future__ import annotations

import numbers
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Literal

import attrs
import trio

from taproute.actors.attempt import calling_loop
from taproute.routing.batch import RecordBatch
from taproute.routing.errors import IngressFull, SinkClosed
from taproute.routing.keys import KeyAction
from taproute.service.host.coalesce import coalesce
from taproute.service.host.counters import IngressCounters
from taproute.service.host.ingress_control import Control, ControlKind, Item

WhenFull = Literal["block", "reject"]


class NotQueued(TimeoutError):
    """A flush or reload whose timeout ran out while it waited for ingress
    room: nothing was queued for it (and nothing is left behind)."""


#: How long a deferred (capture hook) batch may wait before the loop takes it.
#: Every poll costs the loop a fixed amount of Python (a timer's expiry, a
#: dispatch per route, processor calls) on the GIL the model shares, so polls
#: are rare: at 20 ms, GPT-2's forward passes with a forward, a stateless and
#: a stateful route lost several points more to the capture than at 100 ms
#: (bench/profiles/wake_delay_ab_<commit>.txt).  Telemetry reaches its
#: destination up to this much later; ingress half full, a producer about to
#: block, a flush or a close still wake the loop at once.
WAKE_DELAY_S = 0.1

#: How long the record worker's polls must find nothing before it parks.  A
#: wake-up from a hook is a socket write that, on a busy machine, hands the
#: model's core to the loop thread: a model whose hooks pause for a poll or
#: two (a slow step, a preempted thread) must not pay one per pause.
PARK_AFTER_S = 1.0


def thread_wait(timeout: float | None) -> float | None:
    """``timeout`` for a thread wait (``Condition.wait``, ``Future.result``,
    ``Thread.join``): None (no bound) for None or one past what the platform's
    waits take (``math.inf``: as long as it takes), which raise
    OverflowError there.  A timeout that is not a number of seconds (``"1"``,
    NaN) is refused naming it, not compared (a bare TypeError) or taken as
    already past."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or timeout != timeout:
        raise (ValueError if isinstance(timeout, numbers.Real) else TypeError)(
            f"timeout must be seconds (a number) or None, found {type(timeout).__name__} "
            f"{timeout!r}"
        )
    return None if timeout >= threading.TIMEOUT_MAX else timeout


class PendingOffer:
    """A batch a producer waits to queue that it may withdraw (see
    :meth:`Ingress.put_batch_unless`): both flags change under the ingress lock,
    so a withdrawn batch is never queued and a queued one never withdrawn."""

    __slots__ = ("queued", "withdrawn")

    def __init__(self) -> None:
        self.queued = False
        self.withdrawn = False


class Ingress:
    """Bounded, thread-safe queue of batches and controls for one record worker.

    Producers (any threads) serialize on a lock of their own; the record
    worker (one task on the loop thread) calls :meth:`take`, :meth:`done`
    and :meth:`park` without it, except to seal coalesced single records
    and to wake producers blocked for room.  Items of one producer reach
    the record worker in the order that producer queued them.
    """

    def __init__(
        self,
        *,
        capacity_records: int,
        capacity_bytes: int,
        when_full: WhenFull,
        coalesce_records: int,
        wake_delay: float = WAKE_DELAY_S,
        park_after: float = PARK_AFTER_S,
    ) -> None:
        if when_full not in ("block", "reject"):
            raise ValueError(f"when_full must be 'block' or 'reject', got {when_full!r}")
        if capacity_records <= 0 or capacity_bytes <= 0:
            raise ValueError("ingress capacities must be positive")
        self.capacity_records = capacity_records
        self.capacity_bytes = capacity_bytes
        self.when_full = when_full
        self.coalesce_records = coalesce_records
        #: The record worker's poll interval while batches arrive (0: hook
        #: batches wake the loop at every call, as plain submits do).
        self.wake_delay = wake_delay
        #: How long polls must find nothing before the record worker parks.
        self.park_after = park_after
        self.counters = IngressCounters()
        # Producers' lock; the record worker takes it only on slow paths.
        self._lock = threading.Lock()
        self._space = threading.Condition(self._lock)
        self._queue: deque[Item] = deque()
        # Accepted so far (producers, under the lock) and handed on so far
        # (the record worker alone): queued = accepted - handed on.
        self._in_records = 0
        self._in_bytes = 0
        self._out_records = 0
        self._out_bytes = 0
        # Key controls accepted (producers) and run (the record worker).
        self._in_controls = 0
        self._out_controls = 0
        # Flush and reload controls accepted and run (a close takes no room).
        self._in_sink_controls = 0
        self._out_sink_controls = 0
        # Empty batches (queued only for their release) accepted and released.
        self._in_empty = 0
        self._out_empty = 0
        self._pending_rows: list[tuple[int, ...]] = []
        self._pending_payloads: list[bytes] = []
        self._wake: Callable[[], None] | None = None
        #: A wake-up was scheduled and the record worker has not taken since.
        self._wake_pending = False
        #: The record worker sleeps without a poll: the next batch wakes it.
        self._parked = False
        self._closed = False
        self._loop_thread: int | None = None  # the loop thread's ident, once connected
        self._loop_token: trio.lowlevel.TrioToken | None = None  # its Trio token, the same
        self._failed: BaseException | None = None
        self._loop_gone = False
        #: A bounded wait ran out and the record worker has handed nothing on
        #: since: later bounded offers shed at once instead of waiting again,
        #: so one stall costs a forward pass one ``max_block``, not one per hook.
        self._stalled = False

    def connect(self, wake: Callable[[], None]) -> None:
        """Set the function that wakes the record worker (called by producers,
        with their lock held)."""
        self._wake = wake
        self._loop_thread = threading.get_ident()  # called on the loop thread
        try:
            self._loop_token = trio.lowlevel.current_trio_token()
        except RuntimeError:  # connected outside a Trio run (a test's stand-in loop)
            self._loop_token = None

    def refuse_on_loop(self, what: str) -> None:
        """Raise if called on the loop thread, or from a processor or predicate
        this runtime's loop is running in a worker thread, where waiting for
        the loop (a flush, a close, room in a full ingress) would wait forever."""
        if threading.get_ident() == self._loop_thread:
            raise RuntimeError(
                f"{what} on the runtime's own loop thread (from a release callback, a "
                "sink, or a processor or predicate running on the loop) would wait for "
                "that thread, forever: call it from another thread"
            )
        if self._loop_token is not None and calling_loop() is self._loop_token:
            raise RuntimeError(
                f"{what} from inside a processor or predicate this runtime is running "
                "(in a worker thread) would wait for that call to return, forever: "
                "call it from another thread"
            )

    @property
    def closed(self) -> bool:
        """True once a close was queued: nothing more is accepted."""
        return self._closed

    # -- producer side -----------------------------------------------------

    @property
    def queued_records(self) -> int:
        """Records accepted and not yet handed on by the record worker."""
        return self._in_records - self._out_records

    @property
    def deferred(self) -> bool:
        """True while anything is queued (what the record worker's poll takes)."""
        return bool(self._queue) or bool(self._pending_rows)

    @property
    def queued_key_controls(self) -> int:
        """Key controls accepted and not yet run by the record worker."""
        return self._in_controls - self._out_controls

    @property
    def queued_sink_controls(self) -> int:
        """Flush and reload controls accepted and not yet run by the record worker."""
        return self._in_sink_controls - self._out_sink_controls

    def _queued(self) -> int:
        """Records and controls queued, each taking one record's room."""
        return (
            self._in_records
            - self._out_records
            + self._in_controls
            - self._out_controls
            + self._in_sink_controls
            - self._out_sink_controls
            + self._in_empty
            - self._out_empty
        )

    def _fits(self, records: int, nbytes: int, controls: int = 0) -> bool:
        # A queued control (but a close) or empty batch takes one record's
        # room (and no bytes).
        queued = self._queued()
        if queued <= 0:
            return True  # an oversize batch still goes, alone
        return (
            queued + records + controls <= self.capacity_records
            and self._in_bytes - self._out_bytes + nbytes <= self.capacity_bytes
        )

    def _wait_for_space(
        self,
        records: int,
        nbytes: int,
        timeout: float | None = None,
        offer: PendingOffer | None = None,
        controls: int = 0,
        refuse: bool = True,
    ) -> bool:
        """With the lock held: block (or refuse) until the item fits.

        With ``timeout`` (seconds), gives up after that long and returns False;
        with ``offer``, returns False once it is withdrawn.  ``controls``:
        controls (one record's room each, never refused here) besides records.
        ``refuse=False``: wait even under ``when_full="reject"``.
        """
        if self._fits(records, nbytes, controls):
            return True
        if refuse and self.when_full == "reject":
            self.counters.rejected += records
            raise IngressFull(
                f"ingress full ({self.queued_records}/{self.capacity_records} records, "
                f"{self._in_bytes - self._out_bytes}/{self.capacity_bytes} bytes queued); "
                f"{records} record(s) refused"
            )
        timeout = thread_wait(timeout)
        if timeout is None:
            self.refuse_on_loop("a submit that must wait for ingress room")
        self._schedule_wake()  # what waits deferred must drain for room to come
        started = time.perf_counter()
        deadline = None if timeout is None else started + timeout
        # Counted before the last look at the room: the record worker reads it
        # after giving room back, to know whether to wake anyone (see done()).
        self.counters.blocked_producers += 1
        try:
            while not self._fits(records, nbytes, controls):
                self._check_open()
                if offer is not None and offer.withdrawn:
                    return False
                if deadline is None:
                    self._space.wait()
                    continue
                left = deadline - time.perf_counter()
                if left <= 0:
                    return False
                self._space.wait(left)
        finally:
            self.counters.blocked_producers -= 1
            self.counters.blocked_seconds += time.perf_counter() - started
        return True

    def check_open(self) -> None:
        """Raise the latched failure, or SinkClosed once closed (what a
        producer's call that queues nothing still refuses)."""
        with self._lock:
            self._check_open()

    def _check_open(self) -> None:
        if self._failed is not None:
            raise self._failed
        if self._closed:
            raise SinkClosed("runtime is closed; submit refused")

    def _schedule_wake(self) -> None:
        """With the lock held: wake the record worker unless a wake-up is pending."""
        if not self._wake_pending and self._wake is not None:
            self._wake_pending = True
            self._parked = False
            self._wake()

    def try_put_batch(self, batch: RecordBatch) -> bool:
        """Queue ``batch`` if it fits now; False (nothing queued) when it would wait."""
        records = len(batch.descriptors)
        nbytes = batch.payload.nbytes
        empty = _empty(records)
        with self._lock:
            self._check_open()
            if not self._fits(records, nbytes, empty):
                if self.when_full == "block":
                    return False
                self._wait_for_space(records, nbytes, controls=empty)  # raises IngressFull
            self._append_locked(batch, records, nbytes, defer_wake=False)
        return True

    def put_batch(self, batch: RecordBatch, *, defer_wake: bool = False) -> None:
        """Queue one batch; blocks (or raises IngressFull) while ingress is full."""
        self.offer_batch(batch, None, defer_wake=defer_wake)

    def put_batch_unless(self, batch: RecordBatch, offer: PendingOffer) -> bool:
        """:meth:`put_batch` that gives up, queueing nothing, once ``offer`` is
        withdrawn (:meth:`withdraw`): False then, True once queued."""
        records = len(batch.descriptors)
        nbytes = batch.payload.nbytes
        empty = _empty(records)
        with self._lock:
            self._check_open()
            if not self._fits(records, nbytes, empty):
                if not self._wait_for_space(records, nbytes, offer=offer, controls=empty):
                    return False
                self._check_open()
            self._append_locked(batch, records, nbytes, defer_wake=False)
            offer.queued = True
        return True

    def withdraw(self, offer: PendingOffer) -> bool:
        """Withdraw ``offer`` unless it is queued already (False then): its
        :meth:`put_batch_unless` returns False without queueing."""
        with self._lock:
            if offer.queued:
                return False
            offer.withdrawn = True
            self._space.notify_all()
        return True

    def offer_batch(
        self, batch: RecordBatch, timeout: float | None, *, defer_wake: bool = False
    ) -> bool:
        """Queue ``batch``, waiting at most ``timeout`` seconds (None: no bound) for room.

        Returns False (nothing queued; the records counted as shed) when the
        wait ran out: the bound a producer that must not stall sets.  Once a
        wait ran out, later bounded offers that find no room shed at once until
        the record worker hands something on: a stalled destination costs the
        model one ``timeout``, not one per hook of a forward pass.  Every
        capture hook comes this way: a few operations under the producers'
        lock, and no call into the loop unless it sleeps (parked), ingress is
        half full, or ``wake_delay`` is 0.
        """
        records = len(batch.descriptors)
        nbytes = batch.payload.nbytes
        empty = _empty(records)
        with self._lock:
            if self._failed is not None or self._closed:
                self._check_open()
            queued = self._queued()
            if queued > 0 and (
                queued + records + empty > self.capacity_records
                or self._in_bytes - self._out_bytes + nbytes > self.capacity_bytes
            ):
                if (timeout is not None and self._stalled) or not self._wait_for_space(
                    records, nbytes, timeout, controls=empty
                ):
                    self._stalled = True
                    self.counters.shed += records
                    return False
                self._check_open()
            self._append_locked(batch, records, nbytes, defer_wake=defer_wake)
        return True

    def _append_locked(
        self, batch: RecordBatch, records: int, nbytes: int, *, defer_wake: bool
    ) -> None:
        """With the lock held and room checked: queue ``batch``, wake if due."""
        if self._pending_rows:
            self._seal_pending()  # single records queued before it go first
        # Counted before the record worker can see it, so queued never reads low.
        self._in_records += records
        self._in_bytes += nbytes
        self._queue.append(batch)
        counters = self.counters
        counters.submitted += records
        # An empty batch is queued only for its release (on the loop thread,
        # in order); it is no batch of records and the record worker skips it.
        # It takes one record's room until released, so a loop of empty
        # submits against a stalled router cannot grow ingress without bound.
        if records:
            counters.batches += 1
        else:
            self._in_empty += 1
        if not self._wake_pending and (
            not defer_wake
            or self._parked
            or not self.wake_delay
            or 2 * (self._in_records - self._out_records) >= self.capacity_records
            or 2 * (self._in_bytes - self._out_bytes) >= self.capacity_bytes
        ):
            self._schedule_wake()

    def put_record(self, row: tuple[int, ...], payload: bytes) -> None:
        """Queue one record (descriptor fields without offset/length, and its bytes).

        Records queued this way are coalesced into one batch per wake-up.
        """
        nbytes = len(payload)
        with self._lock:
            self._check_open()
            self._wait_for_space(1, nbytes)
            self._check_open()
            self._in_records += 1
            self._in_bytes += nbytes
            self._pending_rows.append(row)
            self._pending_payloads.append(payload)
            self.counters.submitted += 1
            if len(self._pending_rows) >= self.coalesce_records:
                self._seal_pending()
            self._schedule_wake()

    def put_control(
        self,
        kind: ControlKind,
        keys: tuple[int, ...] = (),
        payload: object = None,
        *,
        bounded: bool = False,
        max_block: float | None = None,
        timeout: float | None = None,
    ) -> Future[Any]:
        """Queue a flush, close, reload or key-lifecycle control after everything queued so far.

        A flush (or key control) after a failure or close fails at once; a
        second close is a no-op; a close after a failure still stops the loop.
        A close never waits for room (there is only one): it always gets through.

        A flush or reload takes one record's room until the record worker
        ran it.  A flush finding a flush of its kind last in the queue (no
        record, control or coalesced single record after it) shares that
        one's future instead (counted ``coalesced_flushes``): it covers
        everything queued before this call.  Otherwise, while ingress is
        full, it waits for room at most ``timeout`` seconds (None: no bound),
        under either ``when_full`` (both are calls that wait); past it its
        future fails with :class:`NotQueued` and nothing is queued.

        A key control takes one record's room until the record worker ran it:
        while ingress is full it waits for room (``when_full="block"``), or its
        future fails with :class:`IngressFull` at once, counted
        (``rejected_key_controls``, ``"reject"``).  ``bounded`` (a capture
        block's end): it waits at most ``max_block`` seconds (None: no bound),
        and not at all while a bounded wait already ran out and nothing moved
        since; past it the control is shed, counted (``shed_key_controls``),
        and its future fails with :class:`IngressFull`: the keys stay open.
        """
        control = Control(kind, keys, payload)
        with self._lock:
            if kind != "close" and (self._failed is not None or self._closed):
                self._count_failed_control(kind)
                control.future.set_exception(
                    self._failed or SinkClosed(f"runtime is closed; {kind} refused")
                )
                return control.future
            if self._loop_gone:
                self._count_failed_control(kind)
                control.future.set_exception(self._failed or SinkClosed("runtime loop stopped"))
                return control.future
            if kind == "close":
                if self._closed:
                    control.future.set_result(None)
                    return control.future
                # Close goes through even after a failure: the loop must still stop.
                self._closed = True
                self._space.notify_all()
            if isinstance(kind, KeyAction):
                if not self._room_for_control(control, bounded, max_block):
                    return control.future
            elif kind != "close":
                shared = self._queued_flush(kind)
                if shared is None and not self._fits(0, 0, 1):
                    if not self._wait_for_sink_control(control, timeout):
                        return control.future
                    shared = self._queued_flush(kind)  # queued while this one waited
                if shared is not None:
                    self.counters.coalesced_flushes += 1
                    return shared.future
                self._in_sink_controls += 1
            self._seal_pending()
            self._queue.append(control)
            self._schedule_wake()
        return control.future

    def _room_for_control(self, control: Control, bounded: bool, max_block: float | None) -> bool:
        """With the lock held: wait for one record's room for key ``control``
        as the policy says; True once it fits (counted queued), False (its
        future failed, counted) when refused, shed, or the runtime closed or
        failed while it waited."""
        if not self._fits(0, 0, 1):
            if self.when_full == "reject":
                self.counters.rejected_key_controls += 1
                control.future.set_exception(
                    IngressFull(
                        f"ingress full ({self.queued_records}/{self.capacity_records} records "
                        f"and {self.queued_key_controls} key control(s) queued); "
                        f"{control.kind} of key(s) {_keys(control.keys)} refused: they stay open"
                    )
                )
                return False
            timeout = max_block if bounded else None
            if timeout is None:
                self.refuse_on_loop(f"{control.kind}() that must wait for ingress room")
            shed = timeout is not None and self._stalled
            if not shed:
                try:
                    shed = not self._wait_for_space(0, 0, timeout, controls=1)
                    if not shed:
                        self._check_open()
                except Exception as exc:  # closed or failed while it waited
                    self.counters.failed_key_controls += 1
                    control.future.set_exception(exc)
                    return False
            if shed:
                self._stalled = True
                self.counters.shed_key_controls += 1
                control.future.set_exception(
                    IngressFull(
                        f"{control.kind}: ingress full for longer than max_block ({timeout} s); "
                        f"key(s) {_keys(control.keys)} not ended (shed): they stay open"
                    )
                )
                return False
        self._in_controls += 1
        return True

    def _queued_flush(self, kind: ControlKind) -> Control | None:
        """With the lock held: the flush control of ``kind`` queued last, with
        nothing queued after it (a later flush may share it), else None."""
        if kind not in ("flush", "deliver") or self._pending_rows:
            return None
        try:
            last = self._queue[-1]  # the record worker may take it meanwhile: still in order
        except IndexError:
            return None
        if isinstance(last, Control) and last.kind == kind and not last.future.done():
            return last
        return None

    def _wait_for_sink_control(self, control: Control, timeout: float | None) -> bool:
        """With the lock held: wait at most ``timeout`` seconds for one record's
        room for a flush or reload ``control``; True once it fits, False (its
        future failed: :class:`NotQueued`, or the runtime closed or failed
        while it waited) otherwise."""
        what = "flush(wait=True)" if control.kind == "deliver" else str(control.kind)
        try:
            fits = self._wait_for_space(0, 0, thread_wait(timeout), controls=1, refuse=False)
            if fits:
                self._check_open()
        except Exception as exc:
            closed = self._failed is None and self._closed
            control.future.set_exception(
                SinkClosed(f"runtime is closed; {what} refused") if closed else exc
            )
            return False
        if not fits:
            control.future.set_exception(
                NotQueued(
                    f"{what}: ingress stayed full for {timeout} s (the router is not taking "
                    f"records: {self.queued_records} record(s) and "
                    f"{self.queued_key_controls + self.queued_sink_controls} control(s) "
                    "queued); not queued, nothing left behind"
                )
            )
            return False
        return True

    def _seal_pending(self) -> None:
        """With the lock held: turn coalesced single records into one batch."""
        if not self._pending_rows:
            return
        batch = coalesce(self._pending_rows, self._pending_payloads)
        self._pending_rows, self._pending_payloads = [], []
        self._queue.append(batch)
        self.counters.batches += 1

    # -- record worker side ------------------------------------------------

    def take(self) -> list[Item]:
        """Everything queued now, in order (the coalesced records sealed first).

        Only the record worker calls it.  The flags are cleared before the
        queue is read: a producer that queues meanwhile either has its item
        taken here or finds no wake-up pending and schedules one.
        """
        self._wake_pending = False
        self._parked = False
        if self._pending_rows:
            with self._lock:
                self._seal_pending()
        queue = self._queue
        pop = queue.popleft
        return [pop() for _ in range(len(queue))]

    def park(self) -> bool:
        """The record worker's poll found nothing: may it sleep until woken?

        True (it may: the next item queued wakes it) when nothing is queued;
        False, and nothing changed, when something was queued meanwhile.  The
        flag is raised before the queue is looked at, so an item queued at the
        same moment is either seen here or wakes the worker.
        """
        self._parked = True
        if self._queue or self._pending_rows:
            self._parked = False
            return False
        return True

    def done(
        self,
        records: int,
        nbytes: int,
        controls: int = 0,
        sink_controls: int = 0,
        empty: int = 0,
    ) -> None:
        """The record worker handed batches on (and ran ``controls`` key
        controls, ``sink_controls`` flush and reload controls, released
        ``empty`` empty batches): free their ingress capacity."""
        self._out_records += records
        self._out_bytes += nbytes
        self._out_controls += controls
        self._out_sink_controls += sink_controls
        self._out_empty += empty
        self._stalled = False  # ingress moves again: a bounded offer may wait
        # A producer counts itself blocked before its last look at the room,
        # so one that missed this room is seen here.
        if self.counters.blocked_producers:
            with self._lock:
                self._space.notify_all()

    def fail(self, error: BaseException, *, loop_gone: bool = False) -> list[Item]:
        """A failure was latched (or the loop is gone): wake and refuse every producer.

        With ``loop_gone`` nothing will take the queue any more: it is emptied
        and returned, and later controls fail at once.
        """
        with self._lock:
            if self._failed is None:
                self._failed = error
            self._space.notify_all()
            if not loop_gone:
                return []
            self._loop_gone = True
            self._seal_pending()
            items = list(self._queue)
            self._queue.clear()
            return items

    def count_dropped(self, hook: str, reason: str, records: int) -> None:
        """A producer dropped ``records`` of ``hook`` before submitting them (why: ``reason``)."""
        with self._lock:
            by_reason = self.counters.dropped.setdefault(hook, {})
            by_reason[reason] = by_reason.get(reason, 0) + records

    def count_refused_key_control(self) -> None:
        """A complete/cancel/reopen was refused: a key no stateful route holds."""
        with self._lock:
            self.counters.refused_key_controls += 1

    def count_failed_key_control(self) -> None:
        """A complete/cancel/reopen the runtime could not take any more."""
        with self._lock:
            self.counters.failed_key_controls += 1

    def _count_failed_control(self, kind: ControlKind) -> None:
        """With the lock held: ``kind`` was refused at once; counted if a key control."""
        if isinstance(kind, KeyAction):
            self.counters.failed_key_controls += 1

    def count_skipped(self, hook: str, reason: str) -> None:
        """A producer's hook ran and captured nothing (why: ``reason``)."""
        with self._lock:
            by_reason = self.counters.skipped.setdefault(hook, {})
            by_reason[reason] = by_reason.get(reason, 0) + 1

    def snapshot(self) -> IngressCounters:
        """A detached copy of the ingress counters."""
        with self._lock:
            counters = self.counters
            return attrs.evolve(
                counters,
                queued=self._in_records - self._out_records,
                queued_key_controls=self._in_controls - self._out_controls,
                queued_sink_controls=self._in_sink_controls - self._out_sink_controls,
                dropped={hook: dict(r) for hook, r in counters.dropped.items()},
                skipped={hook: dict(r) for hook, r in counters.skipped.items()},
            )


def _empty(records: int) -> int:
    """The room beside its records an item of ``records`` records takes: an
    empty batch (queued only for its release) takes one record's."""
    return 0 if records else 1


def _keys(keys: tuple[int, ...]) -> str:
    """Keys for a message (the first few of many)."""
    shown = ", ".join(map(str, keys[:8]))
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > 8 else "")
