"""Taking spooled batches to the destination: grouped inserts under stable
tokens, retried while it is unreachable, split when it refuses some records.

A try that fails *transiently* (unreachable, timed out, overloaded) marks the
destination unhealthy and is repeated, unchanged, after a capped backoff, for
as long as the outage lasts.  A try the destination *refuses* (bad data) is
split in halves, each tried under its own token derived from the parent's
(``<token>.0``, ``<token>.1``), down to single records: only the records the
destination refuses go to the dead-letter callback.  Tokens and splits are a
function of the group and of the destination's answers, so a replay after a
crash repeats the same tries and the deduplication window drops the repeats.
"""

from __future__ import annotations

import errno
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import NoReturn, Protocol, TypeVar, runtime_checkable

import numpy as np
import trio

from taproute.routing.batch import Batch, RecordBatch, RowBatch
from taproute.routing.latch import FailureLatch
from taproute.routing.sink import RecordSink
from taproute.service.sinks.spool.files import NO_ROOM
from taproute.service.sinks.spool.health import HealthTracker, SpoolingCounters
from taproute.service.sinks.spool.spool import CannotDeadLetter, DeadLetter, Spool

_log = logging.getLogger("taproute.spool")

T = TypeVar("T")

#: Seconds between tries to record a spool's progress on a disk with no room.
NO_ROOM_WAIT = 1.0
#: Added to an unreachable inner sink's reason while its tables wait for the
#: server (worded as its ``unchecked_reason`` at construction).
UNCHECKED = " (tables not checked yet)"


@runtime_checkable
class InsertsWithToken(Protocol):
    """An inner sink that inserts batches now, idempotently per token; a
    cancelled ``insert_now`` returns at once (an insert in a worker thread
    is abandoned), the batches being the caller's to repeat."""

    async def insert_now(self, batches: Sequence[Batch], token: str) -> None: ...

    def is_transient(self, error: BaseException) -> bool: ...


@runtime_checkable
class DescribesFailures(Protocol):
    """An inner sink that words its failures for the health report (an
    unreachable server named, the driver's long text cut to its reason)."""

    def describe_failure(self, error: BaseException) -> str: ...


@runtime_checkable
class ChecksTablesLater(Protocol):
    """An inner sink built while its server could not be reached, whose tables
    are checked when it is first reached (``check_tables``, blocking: the
    driver's transient error while unreachable, a table's error for good) and
    who writes nothing before (the ClickHouse sink, ``when_unreachable=
    "check_later"``).  ``check_tables`` runs in a worker thread its owner
    abandons at close: it must not fail for the sink being closed under it."""

    @property
    def tables_checked(self) -> bool: ...

    @property
    def unchecked_reason(self) -> str | None: ...

    @property
    def check_failure(self) -> Exception | None: ...

    def check_tables(self) -> None: ...


#: (batches, token they were tried with, the error)
FailedBlock = Callable[[list[Batch], str, BaseException], Awaitable[None]]


@runtime_checkable
class HandsOverFailures(Protocol):
    """An inner sink with its own batched path (rows, bytes, linger) that hands
    a block whose insert failed to its owner instead of retrying it, and
    says how far behind it is (the ClickHouse sink)."""

    def hand_over_failures(
        self, handler: FailedBlock, inserted: Callable[[int, int], None] | None = None
    ) -> None: ...

    @property
    def backlog_bytes(self) -> int: ...

    @property
    def max_backlog_bytes(self) -> int: ...

    async def hand_over_unfinished(self) -> None:
        """Hand every block not persisted yet to the handler now, in order,
        under its token (a try running left to finish, its repeat made to wait
        for it); return once none is left (at once when none is)."""
        ...


@runtime_checkable
class FlushesWithin(Protocol):
    """An inner sink whose flush can stop waiting for its inserts in flight
    after ``within`` seconds, handing their blocks over (the ClickHouse sink:
    its ``close_timeout``; the writer process sink)."""

    @property
    def flush_timeout(self) -> float: ...

    async def flush(self, *, within: float | None = None) -> None: ...


def _default_transient(error: BaseException) -> bool:
    return isinstance(error, (OSError, TimeoutError))


def _records(batches: Sequence[Batch]) -> int:
    return sum(len(b) for b in batches)


def _take(batch: Batch, start: int, stop: int) -> Batch:
    if isinstance(batch, RecordBatch):
        return batch.select(np.arange(start, stop, dtype=np.intp))
    return RowBatch(route=batch.route, layout_name=batch.layout_name, rows=batch.rows[start:stop])


def halves(batches: Sequence[Batch]) -> tuple[list[Batch], list[Batch]]:
    """``batches`` (two records or more) split into two halves by records."""
    half = _records(batches) // 2
    left: list[Batch] = []
    right: list[Batch] = []
    seen = 0
    for batch in batches:
        n = len(batch)
        if seen >= half:
            right.append(batch)
        elif seen + n <= half:
            left.append(batch)
        else:
            cut = half - seen
            left.append(_take(batch, 0, cut))
            right.append(_take(batch, cut, n))
        seen += n
    return left, right


class Delivery:
    """One destination's tries: insert, retry while unreachable, split refusals,
    and the loop that drains the spool in order."""

    def __init__(
        self,
        name: str,
        inner: RecordSink,
        spool: Spool | None,
        tracker: HealthTracker,
        counters: SpoolingCounters,
        latch: FailureLatch,
        *,
        dead_letter: DeadLetter | None,
        group_bytes: int,
    ) -> None:
        self.name = name
        self.inner = inner
        self.spool = spool
        self.tracker = tracker
        self.counters = counters
        self._latch = latch
        self._dead_letter = dead_letter
        self.group_bytes = group_bytes
        self._direct = inner if isinstance(inner, InsertsWithToken) else None
        self._checks = inner if isinstance(inner, ChecksTablesLater) else None

    async def insert(self, batches: Sequence[Batch], token: str) -> None:
        """One try (``insert_now`` with ``token``; another sink: submit + flush)."""
        if self._direct is not None:
            await self._direct.insert_now(batches, token)
        else:
            for batch in batches:
                await self.inner.submit(batch)
            await self.inner.flush()

    def transient(self, error: BaseException) -> bool:
        """Whether the same try may succeed later (unreachable, not refused)."""
        if self._direct is not None:
            return self._direct.is_transient(error)
        return _default_transient(error)

    def unreachable(self, error: BaseException) -> None:
        reason = None
        if isinstance(self.inner, DescribesFailures):
            reason = self.inner.describe_failure(error)
        if reason is not None and self._checks is not None and not self._checks.tables_checked:
            reason += UNCHECKED  # still true until the server answers: keep saying so
        self.tracker.failed(error, reason)
        self.counters.retries += 1

    def spool_failed(self, error: OSError, what: str) -> None:
        """The spool's disk refused ``what`` with an error other than no room
        (``EROFS``, ``EIO``, ``EACCES``): the destination is reported unhealthy,
        naming the error and the spool's directory, until a spool write
        succeeds; the caller sheds (counted) or waits, never raises."""
        assert self.spool is not None
        code = errno.errorcode.get(error.errno or 0, str(error.errno))
        reason = (
            f"spool {self.spool.config.directory} failed ({code}: {error.strerror or error}) {what}"
        )
        if self.tracker.spool_failed(reason):
            _log.error("destination %r: %s: %s", self.name, reason, error)

    async def spool_recovered(self) -> None:
        """A spool operation succeeded.  After a failure, that proves little
        (a frame appended to a segment opened before the file system went
        read-only, a group whose intent was already recorded): the
        destination is healthy again only once the spool's directory takes a
        new file (:meth:`Spool.check_writes`); until then it stays unhealthy,
        and did flicker healthy between a delivery and the next failed write."""
        if self.tracker.spool_failure is None:
            return
        assert self.spool is not None
        try:
            await self.spool.check_writes()
        except OSError as exc:
            if exc.errno not in NO_ROOM:  # still failing; no room is the quota policy's
                return
        if self.tracker.spool_recovered():
            _log.warning(
                "destination %r: spool %s writes again", self.name, self.spool.config.directory
            )

    async def settle(
        self,
        batches: Sequence[Batch],
        token: str,
        error: BaseException | None = None,
        *,
        part: bool = False,
    ) -> int:
        """Deliver ``batches`` under ``token`` (``error``: the first try already
        failed with it): retry while unreachable, split what is refused.
        Returns the records delivered (the rest were refused, and handed over).

        ``part``: a half of a refused group (of the spool's, when it has
        one): delivered once already, before a restart, it is skipped, and
        once delivered it is recorded (``Spool.note_piece``) before the
        next part is tried, so a restart repeats at most the part in flight,
        which then lands right behind its first try (refusals store no
        block): never out of the deduplication window."""
        if part and self.spool is not None and token in self.spool.delivered_pieces:
            return _records(batches)
        while error is None or self.transient(error):
            if error is not None:
                self.unreachable(error)
                await trio.sleep(self.tracker.wait())
            try:
                await self.insert(batches, token)
            except Exception as exc:
                error = exc
                continue
            self.tracker.succeeded()
            if part and self.spool is not None:
                await self._with_room(functools.partial(self.spool.note_piece, token))
            return _records(batches)
        unfit = None if self._checks is None else self._checks.check_failure
        if unfit is not None and error is unfit:
            await self.unusable(unfit)  # a table that doesn't fit: not the records' fault
        rest = list(getattr(error, "rest", batches))  # PartlyInserted: the parts not stored
        delivered = _records(batches) - _records(rest)
        if _records(rest) <= 1:  # a single record (or an empty batch) is refused as it is
            await self.refuse(rest, error)
            return delivered
        left, right = halves(rest)
        delivered += await self.settle(left, f"{token}.0", part=True)
        return delivered + await self.settle(right, f"{token}.1", part=True)

    async def refuse(self, batches: Sequence[Batch], error: BaseException) -> None:
        """Records the destination refused: to the dead-letter callback, or latched."""
        for batch in batches:
            if len(batch) == 0:
                continue
            self.counters.refused_records += len(batch)
            if self._dead_letter is None:
                self._latch.latch(error, destination=self.name, where="insert (refused)")
                return
            reason = f"refused by destination {self.name!r}: {type(error).__name__}: {error}"
            try:
                await self._dead_letter(batch, reason)
            except CannotDeadLetter as exc:
                self.counters.refused_dropped_records += len(batch)
                _log.error(
                    "destination %r: %d refused record(s) dropped: %s", self.name, len(batch), exc
                )

    async def reach(self) -> None:
        """Check the inner sink's tables left unchecked at construction once its
        server answers (retried with backoff while unreachable, the destination
        unhealthy meanwhile); a table that doesn't fit latches its error."""
        checks = self._checks
        if checks is None or checks.tables_checked:
            return
        while True:
            try:
                # Abandoned at close (the sink keeps its transport open under it).
                await trio.to_thread.run_sync(checks.check_tables, abandon_on_cancel=True)
            except Exception as exc:
                if not self.transient(exc):
                    await self.unusable(exc)
                self.unreachable(exc)
                await trio.sleep(self.tracker.wait())
                continue
            self.tracker.succeeded()
            return

    async def unusable(self, error: BaseException) -> NoReturn:
        """The destination's tables don't fit: latch ``error`` and deliver nothing
        more; what the spool holds stays there, for a start with the table fixed."""
        self._latch.latch(
            error, destination=self.name, where="checking its tables when first reached"
        )
        if self.spool is not None:
            self.spool.wake()  # whoever waits for delivery sees the failure now
        await trio.sleep_forever()
        raise AssertionError("unreachable")  # pragma: no cover - sleep_forever never returns

    async def drain(self) -> None:
        """Check tables left unchecked (:meth:`reach`), then deliver the spool's
        frames in order, in groups, until cancelled."""
        spool = self.spool
        assert spool is not None
        await self.reach()
        while True:
            await spool.wait_nonempty()
            group = await self._with_room(functools.partial(spool.read_group, self.group_bytes))
            delivered = await self.settle(group.batches, group.token)
            self.counters.delivered_records += delivered
            self.counters.delivered_batches += len(group.batches)
            await self._with_room(functools.partial(spool.ack, group.seq))

    async def _with_room(self, action: Callable[[], Awaitable[T]]) -> T:
        """``action`` (a group's intent or an ack), again every
        :data:`NO_ROOM_WAIT` seconds while the disk has no room for its few
        bytes: the drain waits for room, the router goes on (a crash
        meanwhile replays the group under its token)."""
        while True:
            try:
                done = await action()
            except OSError as exc:
                if exc.errno not in NO_ROOM:
                    # The disk failed: the frames stay held (not acknowledged),
                    # tried again until it recovers; the router goes on.
                    self.spool_failed(exc, "recording the drain's progress")
                    await trio.sleep(NO_ROOM_WAIT)
                    continue
                _log.warning(
                    "destination %r: spool cannot record its progress (%s); again in %g s",
                    self.name,
                    exc,
                    NO_ROOM_WAIT,
                )
                await trio.sleep(NO_ROOM_WAIT)
            else:
                await self.spool_recovered()
                return done


__all__ = [
    "ChecksTablesLater",
    "Delivery",
    "FailedBlock",
    "HandsOverFailures",
    "InsertsWithToken",
    "halves",
]
