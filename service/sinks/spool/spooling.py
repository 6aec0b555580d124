"""A destination that survives outages: any sink, wrapped with its spool.

:class:`SpoolingSink` is a :class:`~taproute.routing.sink.RecordSink` around
another one (the *inner* sink, e.g. a ClickHouse sink).  Its ``submit`` never
fails because the inner sink can't be reached: a batch the inner sink can't
take now goes to the destination's :class:`~.spool.Spool` and is delivered
later, in order, by this sink's own task (:class:`~.delivery.Delivery`),
retried with capped backoff for as long as the outage lasts.  Meanwhile
:attr:`SpoolingSink.health` says the destination is unhealthy, since when and
why.

Modes (``mode``):

- ``"outage"`` (default): while the destination is healthy and the spool
  empty, batches take the inner sink's own batched path (the ClickHouse
  sink's rows / bytes / linger buffers), untouched.  A block whose insert
  fails is handed back (:class:`~.delivery.HandsOverFailures`) and goes to
  the spool under the token it was tried with, new batches following it
  there until the spool has drained; the drain loop retries it while the
  destination is unreachable, and splits it if refused until only the
  refused records are left, which are dead-lettered.  When the
  inner sink is behind (its backlog past ``spill_at`` of its limit), batches
  go to the spool instead of waiting (*spilled*), and drain back in order.
  A batch goes to the spool (behind or down) only behind every block the
  inner sink has not written yet: those are handed over first, in order
  (``hand_over_unfinished``), so a block whose outcome is unknown is
  repeated before anything spooled after it, within the deduplication
  window.
- ``"always"``: every batch is appended to the spool before ``submit``
  returns (the crash-safe mode), and delivered from there.
- ``"off"``: no spool; ``submit``/``flush`` go straight to the inner sink.

Exactly once: an inner sink offering ``insert_now(batches, token)`` and
``is_transient(error)`` (:class:`~.delivery.InsertsWithToken`, as the
ClickHouse sink does) gets every spooled group with a deduplication token
fixed before its first try and kept through the spool and restarts.  Another
sink gets ``submit`` + ``flush`` and ``OSError``/``TimeoutError`` count as
transient (at-least-once; in ``outage`` mode a batch whose ``submit`` fails
transiently is spooled, and what the inner sink already took is its own).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import attrs
import trio

from taproute.routing.batch import Batch
from taproute.routing.errors import ConfigError, SinkClosed
from taproute.routing.hooks import HookRegistry
from taproute.routing.latch import FailureLatch
from taproute.routing.limits import RELEASE_WITHIN_S
from taproute.routing.sink import (
    CountsInsertErrors,
    GivesUp,
    NamesHooks,
    RecordSink,
    ReleasesWhenCut,
    RunsInBackground,
    SpoolStatus,
)
from taproute.service.sinks.spool.delivery import (
    NO_ROOM_WAIT,
    ChecksTablesLater,
    Delivery,
    FlushesWithin,
    HandsOverFailures,
    InsertsWithToken,
)
from taproute.service.sinks.spool.health import (
    Backoff,
    Health,
    HealthTracker,
    SpoolingCounters,
)
from taproute.service.sinks.spool.spool import DeadLetter, Spool, SpoolCounters, SpoolFull

Mode = Literal["outage", "always", "off"]
MODES: tuple[str, ...] = ("outage", "always", "off")


class SpoolingSink:
    """One destination with its spool (see the module docstring).

    ``spill_at``: the fraction of the inner sink's backlog limit past which
    ``outage`` mode spools instead of waiting; ``group_bytes``: the most
    spooled bytes one drain insert takes.
    """

    def __init__(
        self,
        name: str,
        inner: RecordSink,
        spool: Spool | None,
        *,
        mode: Mode = "outage",
        backoff: Backoff | None = None,
        spill_at: float = 0.75,
        group_bytes: int = 16 << 20,
        drain_on_close: float = 30.0,
        dead_letter: DeadLetter | None = None,
        clock: Callable[[], float] = time.time,
        owns_inner: bool = True,
    ) -> None:
        if mode not in MODES:
            raise ConfigError(f"destination {name!r}: spool must be one of {MODES}, got {mode!r}")
        if mode != "off" and spool is None:
            raise ValueError(f"destination {name!r}: spool={mode!r} needs a Spool")
        if spool is not None and not isinstance(spool, Spool):
            raise TypeError(
                f"destination {name!r}: spool must be a Spool (Spool.open(SpoolConfig("
                f"directory=...))), found {type(spool).__name__} {spool!r:.60}"
            )
        if isinstance(inner, type) or not isinstance(inner, RecordSink):
            raise TypeError(
                f"destination {name!r}: inner must be a RecordSink instance (submit/flush/"
                f"close), found {type(inner).__name__} {inner!r:.60}"
            )
        if not 0 < spill_at <= 1:
            raise ConfigError(f"destination {name!r}: spill_at must be in (0, 1], got {spill_at}")
        self.name = name
        self.inner = inner
        self.spool = spool
        self.mode = mode
        self.spill_at = spill_at
        self.drain_on_close = drain_on_close
        self._owns_inner = owns_inner
        self._latch = FailureLatch()
        self._tracker = HealthTracker(clock, backoff or Backoff())
        self.counters = SpoolingCounters()
        self._delivery = Delivery(
            name,
            inner,
            spool,
            self._tracker,
            self.counters,
            self._latch,
            dead_letter=dead_letter,
            group_bytes=group_bytes,
        )
        # The inner sink's own batched path, when it hands failed blocks back.
        # In ``always`` mode it is told too (its batched path is not used): a
        # sink that adapts to an owner keeping a durable queue does so (a
        # writer process is then restarted however often it dies).
        self._batched: HandsOverFailures | None = None
        if mode != "off" and isinstance(inner, HandsOverFailures):
            if not isinstance(inner, InsertsWithToken):
                raise ConfigError(
                    f"destination {name!r}: a sink handing blocks back needs insert_now"
                )
            if mode == "outage":
                self._batched = inner
            inner.hand_over_failures(self._failed_block, self._inserted)
        if isinstance(inner, ChecksTablesLater) and inner.unchecked_reason is not None:
            # Built while its server was down: unhealthy (batches spool) until
            # the drain reaches it and its tables are checked.
            self._tracker.failed(ConnectionError(inner.unchecked_reason), inner.unchecked_reason)
        self._in_inner = 0  # records passed to the inner sink, not yet inserted nor handed back
        self._nursery: trio.Nursery | None = None
        self._closing = False
        self._stopped = trio.Event()

    # -- lifecycle ---------------------------------------------------------
    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Run the inner sink's task (when owned) and the drain loop until ``close``."""
        if self._nursery is not None:
            raise RuntimeError(f"SpoolingSink {self.name!r}: run() can only be started once")
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                if self._owns_inner and isinstance(self.inner, RunsInBackground):
                    await nursery.start(self.inner.run)
                if self.mode != "off":
                    nursery.start_soon(self._delivery.drain)
                task_status.started()
                await self._stopped.wait()
                nursery.cancel_scope.cancel()
        finally:
            self._stopped.set()

    @property
    def running(self) -> bool:
        return self._nursery is not None and not self._stopped.is_set()

    @property
    def failure(self) -> BaseException | None:
        """The latched failure (a refused batch with no dead-letter store), or None."""
        return self._latch.failure

    @property
    def health(self) -> Health:
        """Reachability, and the spool's disk: unhealthy while either fails."""
        return self._tracker.reported

    def use_blocking_budget(self, seconds: float) -> None:
        """Bound a ``block`` at the spool's quota by ``seconds`` (the runtime's
        ``max_block``) unless its ``block_timeout`` is set."""
        if self.spool is not None:
            self.spool.use_blocking_budget(seconds)

    def use_hooks(self, hooks: HookRegistry) -> None:
        """Hand the producer's hook registry to the spool (frames keep their
        records' hook names) and to the inner sink, if it names hooks."""
        if self.spool is not None:
            self.spool.use_hooks(hooks)
        if isinstance(self.inner, NamesHooks):
            self.inner.use_hooks(hooks)

    # -- RecordSink ----------------------------------------------------------
    async def submit(self, batch: Batch) -> None:
        """Accept ``batch``: the inner sink's path while it keeps up (``outage``),
        else the spool."""
        self._latch.raise_if_failed()
        if self._closing:
            raise SinkClosed(f"destination {self.name!r} is closed")
        if self.mode == "off":
            await self.inner.submit(batch)
            return
        records = len(batch)
        self.counters.accepted_records += records
        if self.mode == "always":
            await self._append([batch])
            return
        if not self._tracker.health.healthy:
            await self._spool_behind_inner(batch)
            return
        assert self.spool is not None
        behind = self._batched is not None and (
            self._batched.backlog_bytes + batch.nbytes
            > self._batched.max_backlog_bytes * self.spill_at
        )
        if behind or len(self.spool):  # behind, not down (or following what was)
            self.counters.spilled_records += records
            await self._spool_behind_inner(batch)
            return
        try:
            await self.inner.submit(batch)
        except Exception as exc:
            if self._batched is not None or not self._delivery.transient(exc):
                raise
            self._delivery.unreachable(exc)
            await self._append([batch])
            return
        self._in_inner += records

    async def _spool_behind_inner(self, batch: Batch) -> None:
        """Spool ``batch`` (``outage`` mode), after every block the inner sink
        has not persisted yet: those are handed over first, in order, under
        their tokens.  Spooled ahead of them, the batch was drained (first
        tries) while such a block's outcome was unknown, and the block, when
        it failed, was repeated behind it and everything else spooled
        meanwhile: out of the deduplication window, written twice."""
        if self._batched is not None and self._batched.backlog_bytes:
            await self._batched.hand_over_unfinished()
        await self._append([batch])

    async def _append(self, batches: Sequence[Batch], token: str | None = None) -> None:
        assert self.spool is not None
        try:
            await self.spool.append(batches, token)
        except SpoolFull:  # ``block`` ran out of time: shed, counted
            self.counters.shed_records += sum(len(b) for b in batches)
        except OSError as exc:
            # The disk refused the frame for another reason than room (a
            # full disk is the quota policy's, in the spool): EROFS, EIO,
            # EACCES.  This destination sheds (counted) and is unhealthy
            # with the reason; raising latched the router's failure and
            # stopped every destination.
            self.counters.shed_records += sum(len(b) for b in batches)
            self._delivery.spool_failed(exc, "appending: records shed")
        else:
            await self._delivery.spool_recovered()

    async def _failed_block(self, batches: list[Batch], token: str, error: BaseException) -> None:
        """The inner sink's block failed: spool it under the token it was tried
        with.  Unreachable, the destination is unhealthy from now; refused,
        the drain loop splits it (durable first, and never holding up the
        inner sink's flush while the split's tries wait out an outage)."""
        self._in_inner -= sum(len(b) for b in batches)
        if self._delivery.transient(error):
            self._delivery.unreachable(error)
        await self._append(batches, token)

    def _inserted(self, records: int, batches: int) -> None:
        self._in_inner -= records
        self.counters.delivered_records += records
        self.counters.delivered_batches += batches

    async def _flush_inner(self) -> None:
        if self.mode != "outage":
            return
        passed = self._in_inner if self._batched is None else 0
        if self._batched is not None and isinstance(self.inner, FlushesWithin):
            # Inserts in flight are handed to the spool (same token) rather
            # than waited for past flush_timeout (close_timeout); at once while unreachable.
            healthy = self._tracker.health.healthy
            await self.inner.flush(within=self.inner.flush_timeout if healthy else 0.0)
        else:
            await self.inner.flush()
        if self._batched is None:  # another sink: its flush is its delivery
            self._in_inner -= passed
            self.counters.delivered_records += passed

    async def flush(self) -> None:
        """Return once every batch submitted before is delivered, dead-lettered,
        or durable in the spool (fsynced); raise a latched failure."""
        self._latch.raise_if_failed()
        if self.mode == "off":
            await self.inner.flush()
            return
        await self._flush_inner()
        assert self.spool is not None
        await self.spool.sync()
        self._latch.raise_if_failed()

    async def wait_delivered(self) -> None:
        """Return once nothing is held in the inner sink or the spool: everything
        accepted so far is delivered (or dead-lettered / shed, and counted)."""
        if self.mode == "off":
            await self.inner.flush()
            return
        assert self.spool is not None
        while True:
            await self._flush_inner()
            if not len(self.spool):
                return
            while len(self.spool):
                self._latch.raise_if_failed()
                await self.spool.wait_changed()

    async def close(self) -> None:
        """Flush; while the destination is healthy, deliver what is held for up to
        ``drain_on_close`` seconds; then stop (the spool keeps the rest for the
        next start) and close.  Unhealthy, it stops right after the flush: the
        drain's try in flight is abandoned, not waited for (its group stays
        unacknowledged, repeated under the same token next time).  A close
        cancelled while it waits still closes the inner sink (when owned:
        a ClickHouse sink releases its transport) and the spool."""
        if self._closing:
            await self._stopped.wait()
            return
        try:
            if self.running:
                await self.flush()
                if self.mode != "off":
                    with trio.move_on_after(self.drain_on_close):
                        await self._drain_while_healthy()
        finally:
            self._closing = True
            self._stopped.set()
            try:
                if self._owns_inner:
                    await self.inner.close()
            finally:
                if self.spool is not None:
                    # Also when close was cancelled (the spool kept its files
                    # and its directory's lock: a restart in the process
                    # raised SpoolLocked); it waits only for a spool file
                    # call in its worker thread, at most RELEASE_WITHIN_S.
                    with trio.move_on_after(RELEASE_WITHIN_S, shield=True):
                        await self.spool.aclose()

    async def release_when_cut(self) -> None:
        """A shutdown's cut cancelled the run task and this sink will not be
        closed: release the inner sink's transport (when owned; see
        :class:`~taproute.routing.sink.ReleasesWhenCut`) and close the
        spool's files, which also lets go of its directory's lock (a restart
        in this process raised SpoolLocked).  Waits only for a spool file
        call still in its worker thread; what the spool holds stays for the
        next start."""
        self._closing = True
        self._stopped.set()
        if self._owns_inner and isinstance(self.inner, ReleasesWhenCut):
            await self.inner.release_when_cut()
        if self.spool is not None:
            await self.spool.aclose()

    async def _drain_while_healthy(self) -> None:
        assert self.spool is not None
        # Not while its disk fails: no acknowledgement could be recorded (the
        # drain's failure changes nothing in the spool: looked at every second).
        while self._tracker.reported.healthy and len(self.spool):
            if self._latch.failure is not None:
                return
            with trio.move_on_after(NO_ROOM_WAIT):
                await self.spool.wait_changed()

    # -- observation -----------------------------------------------------------
    def insert_errors(self) -> int:
        """The inner sink's failed insert attempts (``CountsInsertErrors``), or 0."""
        inner = self.inner
        return inner.insert_errors() if isinstance(inner, CountsInsertErrors) else 0

    def given_up_records(self) -> int:
        """Records this destination took and then lost: those its inner sink
        gave up (``GivesUp``: the rows a ClickHouse sink had buffered or was
        inserting when a shutdown's cut cancelled it, its ``abandoned_rows``).
        What the spool holds is not given up, even when the cut abandoned
        the drain's insert of it: it stays unacknowledged on disk and is
        delivered at the next start (under the same token: once), and so is
        a block the inner sink was handing back to the spool when the cut
        came once its frame is written (the spool finishes that append).
        One the cut stopped before its frame was written (waiting for the
        spool's lock or room) is counted by the inner sink: not kept."""
        return self.inner.given_up_records() if isinstance(self.inner, GivesUp) else 0

    def spool_status(self) -> SpoolStatus:
        """Health and holdings, for the destination's counters (``/status``, ``/metrics``)."""
        spool = self.spool.snapshot() if self.spool is not None else SpoolCounters()
        health = self._tracker.reported
        return SpoolStatus(
            healthy=health.healthy,
            unhealthy_since=None if health.healthy else health.since,
            reason=health.reason,
            bytes=spool.bytes,
            segments=spool.segments,
            oldest_unacked_age_s=spool.oldest_unacked_age_s,
            drained_records=spool.acked_records,
            shed_records=(
                spool.dropped_records + spool.dead_lettered_records + self.counters.shed_records
            ),
            refused_records=self.counters.refused_records,
        )

    def snapshot(self) -> SpoolingCounters:
        """A detached copy of the counters, with the spool's."""
        return attrs.evolve(
            self.counters,
            memory_records=self._in_inner,
            spool=self.spool.snapshot() if self.spool is not None else SpoolCounters(),
        )


__all__ = [
    "MODES",
    "Backoff",
    "Health",
    "InsertsWithToken",
    "Mode",
    "SpoolingCounters",
    "SpoolingSink",
]
