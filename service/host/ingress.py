"""The thread-safe ingress between producer threads and the Trio loop.

Producers append batches (or single records, which are coalesced into one
batch) under a lock; the first append after the loop last looked schedules
one wake-up with ``TrioToken.run_sync_soon``; the record worker takes
everything queued at once.

Capture hooks (``defer_wake``) do not wake the loop themselves: a wake-up
costs the model thread a socket write and, worse, hands the GIL to the loop
thread in the middle of the forward pass.  Their batches wait until a later
append finds the oldest one ``wake_delay`` old (or ingress half full), a
producer is about to block, a flush or close arrives, or the record worker's
own poll (every ``wake_delay``) finds them: one wake-up for several hook
calls, and the GIL handed over outside the hooks.  Capacity is counted in records and bytes until
the record worker has handed a batch on, so a blocked record worker fills
ingress, and full ingress blocks (or refuses) the producer.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Literal

import attrs
import numpy as np

from taproute.native import DESCRIPTOR_DTYPE
from taproute.routing.batch import RecordBatch
from taproute.routing.errors import IngressFull, SinkClosed
from taproute.routing.keys import KeyAction
from taproute.service.host.counters import IngressCounters

WhenFull = Literal["block", "reject"]

#: How long a deferred (capture hook) batch may wait before the loop takes it.
WAKE_DELAY_S = 0.02


#: A flush, a close, a key-lifecycle request (with its keys) or a reload;
#: ``deliver`` is a flush that waits for full delivery (``flush(wait=True)``).
ControlKind = Literal["flush", "deliver", "close", "reload"] | KeyAction


class Control:
    """A flush, close, key-lifecycle request (``keys``) or reload (``payload``:
    the prepared generation), ordered with the batches around it."""

    __slots__ = ("future", "keys", "kind", "payload")

    def __init__(
        self, kind: ControlKind, keys: tuple[int, ...] = (), payload: object = None
    ) -> None:
        self.kind = kind
        self.keys = keys
        self.payload = payload
        #: Done with None, or a flush's report.
        self.future: Future[Any] = Future()


Item = RecordBatch | Control


class Ingress:
    """Bounded, thread-safe queue of batches and controls for one record worker."""

    def __init__(
        self,
        *,
        capacity_records: int,
        capacity_bytes: int,
        when_full: WhenFull,
        coalesce_records: int,
        wake_delay: float = WAKE_DELAY_S,
    ) -> None:
        if when_full not in ("block", "reject"):
            raise ValueError(f"when_full must be 'block' or 'reject', got {when_full!r}")
        if capacity_records <= 0 or capacity_bytes <= 0:
            raise ValueError("ingress capacities must be positive")
        self.capacity_records = capacity_records
        self.capacity_bytes = capacity_bytes
        self.when_full = when_full
        self.coalesce_records = coalesce_records
        self.wake_delay = wake_delay
        self.counters = IngressCounters()
        self._cond = threading.Condition(threading.Lock())
        self._queue: deque[Item] = deque()
        self._records = 0
        self._bytes = 0
        self._pending_rows: list[tuple[int, ...]] = []
        self._pending_payloads: list[bytes] = []
        self._wake: Callable[[], None] | None = None
        self._wake_pending = False
        #: When the oldest batch queued without a wake-up was queued (None: none is).
        self._deferred_since: float | None = None
        self._closed = False
        self._failed: BaseException | None = None
        self._loop_gone = False

    def connect(self, wake: Callable[[], None]) -> None:
        """Set the function that wakes the record worker (called with the lock held)."""
        self._wake = wake

    # -- producer side -----------------------------------------------------

    def _wait_for_space(self, records: int, nbytes: int, timeout: float | None = None) -> bool:
        """With the lock held: block (or refuse) until the item fits.

        With ``timeout`` (seconds), gives up after that long and returns False.
        """
        if self._fits(records, nbytes):
            return True
        if self.when_full == "reject":
            self.counters.rejected += records
            raise IngressFull(
                f"ingress full ({self._records}/{self.capacity_records} records, "
                f"{self._bytes}/{self.capacity_bytes} bytes queued); {records} record(s) refused"
            )
        self._schedule_wake()  # what waits deferred must drain for room to come
        started = time.perf_counter()
        deadline = None if timeout is None else started + timeout
        self.counters.blocked_producers += 1
        try:
            while not self._fits(records, nbytes):
                self._check_open()
                if deadline is None:
                    self._cond.wait()
                    continue
                left = deadline - time.perf_counter()
                if left <= 0:
                    return False
                self._cond.wait(left)
        finally:
            self.counters.blocked_producers -= 1
            self.counters.blocked_seconds += time.perf_counter() - started
        return True

    def _fits(self, records: int, nbytes: int) -> bool:
        if self._records == 0:
            return True  # an oversize batch still goes, alone
        return (
            self._records + records <= self.capacity_records
            and self._bytes + nbytes <= self.capacity_bytes
        )

    def _check_open(self) -> None:
        if self._failed is not None:
            raise self._failed
        if self._closed:
            raise SinkClosed("runtime is closed; submit refused")

    @property
    def deferred(self) -> bool:
        """True while batches wait without a wake-up (read by the record worker's poll)."""
        return self._deferred_since is not None

    def _schedule_wake(self) -> None:
        if not self._wake_pending and self._wake is not None:
            self._wake_pending = True
            self._deferred_since = None
            self._wake()

    def _schedule_deferred_wake(self) -> None:
        """With the lock held: wake only when what waits is old or ingress fills."""
        if self._wake_pending:
            return
        now = time.monotonic()
        if self._deferred_since is None:
            self._deferred_since = now
        if (
            now - self._deferred_since >= self.wake_delay
            or 2 * self._records >= self.capacity_records
            or 2 * self._bytes >= self.capacity_bytes
        ):
            self._schedule_wake()

    def try_put_batch(self, batch: RecordBatch) -> bool:
        """Queue ``batch`` if it fits now; False (nothing queued) when it would wait."""
        with self._cond:
            self._check_open()
            if self.when_full == "block" and not self._fits(len(batch), batch.payload.nbytes):
                return False
            self._put_locked(batch)
            return True

    def put_batch(self, batch: RecordBatch, *, defer_wake: bool = False) -> None:
        """Queue one batch; blocks (or raises IngressFull) while ingress is full."""
        with self._cond:
            self._put_locked(batch, defer_wake=defer_wake)

    def offer_batch(self, batch: RecordBatch, timeout: float, *, defer_wake: bool = False) -> bool:
        """Queue ``batch``, waiting at most ``timeout`` seconds for room.

        Returns False (nothing queued; the records counted as shed) when the
        wait ran out: the bound a producer that must not stall sets.
        """
        with self._cond:
            return self._put_locked(batch, timeout, defer_wake=defer_wake)

    def _put_locked(
        self, batch: RecordBatch, timeout: float | None = None, *, defer_wake: bool = False
    ) -> bool:
        """With the lock held: wait for space (or refuse), then queue ``batch``."""
        records, nbytes = len(batch), batch.payload.nbytes
        self._check_open()
        if not self._wait_for_space(records, nbytes, timeout):
            self.counters.shed += records
            return False
        self._check_open()
        self._seal_pending()
        self._queue.append(batch)
        self.counters.batches += 1
        self._account(records, nbytes, defer_wake=defer_wake)
        return True

    def put_record(self, row: tuple[int, ...], payload: bytes) -> None:
        """Queue one record (descriptor fields without offset/length, and its bytes).

        Records queued this way are coalesced into one batch per wake-up.
        """
        with self._cond:
            self._check_open()
            self._wait_for_space(1, len(payload))
            self._check_open()
            self._pending_rows.append(row)
            self._pending_payloads.append(payload)
            self._account(1, len(payload))
            if len(self._pending_rows) >= self.coalesce_records:
                self._seal_pending()

    def _account(self, records: int, nbytes: int, *, defer_wake: bool = False) -> None:
        self._records += records
        self._bytes += nbytes
        self.counters.submitted += records
        self.counters.queued = self._records
        if defer_wake:
            self._schedule_deferred_wake()
        else:
            self._schedule_wake()

    def put_control(
        self, kind: ControlKind, keys: tuple[int, ...] = (), payload: object = None
    ) -> Future[Any]:
        """Queue a flush, close or key-lifecycle control after everything queued so far.

        A flush (or key control) after a failure or close fails at once; a
        second close is a no-op; a close after a failure still stops the loop.
        """
        control = Control(kind, keys, payload)
        with self._cond:
            if kind != "close" and (self._failed is not None or self._closed):
                control.future.set_exception(
                    self._failed or SinkClosed(f"runtime is closed; {kind} refused")
                )
                return control.future
            if self._loop_gone:
                control.future.set_exception(self._failed or SinkClosed("runtime loop stopped"))
                return control.future
            if kind == "close":
                if self._closed:
                    control.future.set_result(None)
                    return control.future
                # Close goes through even after a failure: the loop must still stop.
                self._closed = True
                self._cond.notify_all()
            self._seal_pending()
            self._queue.append(control)
            self._schedule_wake()
        return control.future

    def _seal_pending(self) -> None:
        """With the lock held: turn coalesced single records into one batch."""
        rows = self._pending_rows
        if not rows:
            return
        payloads = self._pending_payloads
        self._pending_rows, self._pending_payloads = [], []
        desc = np.array(rows, dtype=_ROW_DTYPE)
        full = np.empty(len(rows), dtype=DESCRIPTOR_DTYPE)
        for name in _ROW_DTYPE.names or ():
            full[name] = desc[name]
        lengths = np.fromiter((len(p) for p in payloads), dtype=np.int64, count=len(payloads))
        full["length"] = lengths
        full["offset"][0] = 0
        np.cumsum(lengths[:-1], out=full["offset"][1:])
        self._queue.append(RecordBatch.from_buffer(full, b"".join(payloads)))
        self.counters.batches += 1

    # -- record worker side ------------------------------------------------

    def take(self) -> list[Item]:
        """Everything queued now, in order (the coalesced records sealed first)."""
        with self._cond:
            self._wake_pending = False
            self._deferred_since = None
            self._seal_pending()
            items = list(self._queue)
            self._queue.clear()
        return items

    def done(self, records: int, nbytes: int) -> None:
        """The record worker handed a batch on: free its ingress capacity."""
        with self._cond:
            self._records -= records
            self._bytes -= nbytes
            self.counters.queued = self._records
            self._cond.notify_all()

    def fail(self, error: BaseException, *, loop_gone: bool = False) -> list[Item]:
        """A failure was latched (or the loop is gone): wake and refuse every producer.

        With ``loop_gone`` nothing will take the queue any more: it is emptied
        and returned, and later controls fail at once.
        """
        with self._cond:
            if self._failed is None:
                self._failed = error
            self._cond.notify_all()
            if not loop_gone:
                return []
            self._loop_gone = True
            self._seal_pending()
            items = list(self._queue)
            self._queue.clear()
            return items

    def count_dropped(self, hook: str, reason: str, records: int) -> None:
        """A producer dropped ``records`` of ``hook`` before submitting them (why: ``reason``)."""
        with self._cond:
            by_reason = self.counters.dropped.setdefault(hook, {})
            by_reason[reason] = by_reason.get(reason, 0) + records

    def count_skipped(self, hook: str, reason: str) -> None:
        """A producer's hook ran and captured nothing (why: ``reason``)."""
        with self._cond:
            by_reason = self.counters.skipped.setdefault(hook, {})
            by_reason[reason] = by_reason.get(reason, 0) + 1

    def snapshot(self) -> IngressCounters:
        """A detached copy of the ingress counters."""
        with self._cond:
            counters = self.counters
            return attrs.evolve(
                counters,
                dropped={hook: dict(r) for hook, r in counters.dropped.items()},
                skipped={hook: dict(r) for hook, r in counters.skipped.items()},
            )


#: Descriptor fields a single-record submit provides (offset/length come at seal time).
_ROW_DTYPE = np.dtype(
    [
        (name, DESCRIPTOR_DTYPE.fields[name][0])  # type: ignore[index]
        for name in ("output_id", "layout_id", "flags", "key", "step", "seq", "timestamp_ns")
    ]
)
