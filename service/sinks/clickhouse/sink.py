"""ClickHouseSink: batches rows like a log shipper and inserts them in worker
threads, through chDB (embedded) or a server (clickhouse-connect).

Delivery guarantee: every record a sink accepts is inserted at least once,
and retries of one insert carry the same ``insert_deduplication_token``, so
ClickHouse writes each buffered block once (within the table's
deduplication window; a table without one is refused at construction unless
``require_deduplication=False`` accepts duplicates).  That window must
still remember every block of the first try when a repeat comes, one per
partition the insert touched.  A table's blocks start in order, block ``i``
only once every block before ``i - inserts_in_flight + 1`` is done, so
while one is not (its outcome unknown) at most ``2 x inserts_in_flight - 1``
inserts land between its first try and its last repeat; a table whose
window is shorter is refused at construction, every insert is written as
one block per partition (never cut at ClickHouse's million-row block
size), and one may touch at most ``window // those inserts`` partitions:
an insert touching more is refused with nothing written
(:class:`TooManyPartitions`, not retried; a spool splits it).  A block that
still fails after the retry budget is not written: the failure is latched
and raised by the next ``submit``/``flush``/``close``, never swallowed.  An owner with its own
durable queue (a spooling destination) may take failed blocks over instead
(``hand_over_failures``; each table's in its order, a refused one behind
the blocks tried beside it, the blocks not started after a handed-over one
following it untried), take every unfinished block over before it spools
batches behind them (``hand_over_unfinished``), and
insert batches itself (``insert_now``, which waits for a try of the table
this sink stopped waiting for to return first).

Settings live in ``batching.py``, Arrow conversion in ``columns.py``, the
split by table in ``tables.py``, a table's buffer and counters in
``blocks.py``, what an owner with its own durable queue calls (hand-over,
``insert_now``) in ``owner_inserts.py``; this module is the sink's one
lifecycle: buffers, the linger timer, insert tasks and their counters.
"""

from __future__ import annotations

import contextlib
import math
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal

import attrs
import pyarrow as pa
import trio

from taproute.routing.batch import Batch, Retained, RowBatch
from taproute.routing.errors import ConfigError, SinkClosed
from taproute.routing.hooks import HookRegistry
from taproute.routing.latch import FailureLatch
from taproute.routing.limits import RELEASE_WITHIN_S
from taproute.routing.schema import RecordSchema, expect_schema
from taproute.routing.sink import Reach
from taproute.service.sinks.clickhouse import arguments
from taproute.service.sinks.clickhouse.abandonable import AbandonableCalls
from taproute.service.sinks.clickhouse.batching import Batching, Retry, seal_due
from taproute.service.sinks.clickhouse.blocks import (
    HeldAttempt,
    InsertAbandoned,
    TableBuffer,
    TableCounters,
    TableOrder,
    inserts_between_repeats,
)
from taproute.service.sinks.clickhouse.columns import HookDictionary, block_table
from taproute.service.sinks.clickhouse.deduplication import (
    PartitionAllowance,
    TooManyPartitions,
    too_many_partitions,
)
from taproute.service.sinks.clickhouse.handover import FailedBlockHandler
from taproute.service.sinks.clickhouse.liveness import run_watched
from taproute.service.sinks.clickhouse.owner_inserts import OwnerInserts
from taproute.service.sinks.clickhouse.table_checks import TableChecks
from taproute.service.sinks.clickhouse.tables import (
    TableSpec,
    raw_table_spec,
    rows_table_spec,
    split_by_table,
)
from taproute.service.sinks.clickhouse.transport import (
    ChdbTransport,
    ServerTransport,
    Transport,
)

#: What a sink does when its server can't be reached at construction.
WhenUnreachable = Literal["refuse", "check_later"]


class HeldBack(Exception):
    """A block handed to the owner untried: an earlier block of its table is
    in the owner's hands, and its repeat must come first (and find the
    table's deduplication window holding what it tried)."""

    def __init__(self, table: str, token: str) -> None:
        super().__init__(
            f"held back (an earlier insert into table {table!r} is being repeated by the "
            f"owner): block {token}"
        )


class Yielded(Exception):
    """A block handed to the owner before its outcome was known, so that what
    the owner spools next lands behind it: the owner had batches to spool
    (its destination behind, or down) while this block was still being
    inserted, or waiting for its turn.  An insert of it that had started runs
    on in its thread; the owner's repeat (``insert_now``, same token) waits
    for that try to return, so it finds the try in the deduplication window.
    Not a failure of the destination's."""

    def __init__(self, table: str, token: str, *, tried: bool) -> None:
        started = "its insert runs on in its thread" if tried else "not tried yet"
        super().__init__(
            f"handed to the spool before its outcome was known ({started}): the destination's "
            f"batches are being spooled, and table {table!r} repeats this block first: "
            f"block {token}"
        )


class ClickHouseSink(OwnerInserts):
    """A :class:`~taproute.routing.sink.RecordSink` writing to ClickHouse tables.

    ``raw`` names the payload layouts whose raw records this sink accepts
    (table ``raw_table.format(layout=...)``, default ``raw_<layout>``);
    ``rows`` the output layouts whose processed rows it accepts (table
    ``rows_table.format(...)``, default the layout's name).  Every table is
    checked at construction (``DESCRIBE TABLE``); a missing one is created
    when ``create_tables`` is on, else :class:`MissingTable`; a column of the
    wrong type raises :class:`SchemaMismatch` naming table, column, expected
    and found; a table that would write a retried block twice (no
    deduplication window) raises :class:`NoDeduplication` saying how to fix
    it, unless ``require_deduplication=False`` (at-least-once).  A failed
    constructor closes the transport it owns.  A server that can't be reached
    then raises :class:`ServerUnreachable`, unless ``when_unreachable=
    "check_later"``: the tables are then checked when the server is first
    reached, before any block is written (for a spooling destination, whose
    batches spool meanwhile; see :mod:`.table_checks`).

    ``close_timeout`` (seconds, default 10) bounds how long :meth:`close`
    waits for the inserts in flight; past it they are abandoned: an owner
    takes their blocks, else their rows are counted (``abandoned_rows``) and
    close raises :class:`InsertAbandoned` as the latched failure.

    Use :meth:`embedded` for chDB in a local directory, :meth:`server` for a
    ClickHouse server.  Needs its :meth:`run` task (the runtime and routing
    sink start it; a Trio program uses ``async with sink.running()``).
    """

    def __init__(
        self,
        transport: Transport,
        schema: RecordSchema,
        *,
        raw: Iterable[str] = (),
        rows: Iterable[str] = (),
        create_tables: bool = False,
        raw_table: str = "raw_{layout}",
        rows_table: str = "{layout}",
        hooks: HookRegistry | None = None,
        batching: Batching | None = None,
        retry: Retry | None = None,
        owns_transport: bool = True,
        require_deduplication: bool = True,
        when_unreachable: WhenUnreachable = "refuse",
        close_timeout: float = 10.0,
    ) -> None:
        arguments.check_kinds(
            batching=batching,
            retry=retry,
            create_tables=create_tables,
            require_deduplication=require_deduplication,
        )
        if not (isinstance(close_timeout, (int, float)) and 0 <= close_timeout < math.inf):
            raise ConfigError(f"close_timeout must be seconds >= 0, got {close_timeout!r}")
        if when_unreachable not in ("refuse", "check_later"):
            raise ConfigError(
                f"when_unreachable must be 'refuse' or 'check_later', got {when_unreachable!r}"
            )
        self.transport = transport
        self.schema = expect_schema(schema, "ClickHouseSink(transport, schema, ...)")
        self.hooks = hooks
        self.batching = batching or Batching()
        self.retry = retry or Retry()
        #: Seconds close() waits for inserts in flight (see :meth:`flush`).
        self.close_timeout = float(close_timeout)
        self._owns_transport = owns_transport
        #: Every blocking call on the transport goes through it, so the
        #: transport is never closed under a call (even an abandoned one).
        self._calls = AbandonableCalls(
            f"the transport to {transport.description}",
            transport.close if owns_transport else None,
        )
        try:  # a failed constructor releases what it opened (the chDB directory)
            self._raw: dict[int, TableSpec] = {}
            self._rows: dict[str, TableSpec] = {}
            for name in arguments.layouts("raw", raw):
                layout = schema.layout(name)
                layout.check_payload_layout()
                self._raw[schema.layout_id(name)] = raw_table_spec(
                    layout, arguments.table_name("raw_table", raw_table, name)
                )
            for name in arguments.layouts("rows", rows):
                layout = schema.layout(name)
                self._rows[name] = rows_table_spec(
                    layout, arguments.table_name("rows_table", rows_table, name)
                )
            if not self._raw and not self._rows:
                raise ConfigError(
                    "ClickHouseSink needs raw=[payload layouts] and/or rows=[output layouts] "
                    "to write"
                )
            self.tables: dict[str, TableSpec] = {
                spec.name: spec for spec in [*self._raw.values(), *self._rows.values()]
            }
            self._checks = TableChecks(
                transport,
                self.tables.values(),
                create=create_tables,
                require_deduplication=require_deduplication,
                inserts=inserts_between_repeats(self.batching.inserts_in_flight),
            )
            self._checks.at_construction(later=when_unreachable == "check_later")
        except BaseException:
            if owns_transport:
                transport.close()
            raise
        self.counters: dict[str, TableCounters] = {n: TableCounters(n) for n in self.tables}
        self._buffers: dict[str, TableBuffer] = {n: TableBuffer() for n in self.tables}
        self._limiters = {
            n: trio.CapacityLimiter(self.batching.inserts_in_flight) for n in self.tables
        }
        self._hook_dictionary = HookDictionary()
        self._token_prefix = uuid.uuid4().hex
        self._block_seq = 0
        self._latch = FailureLatch()
        self._failed_blocks: FailedBlockHandler | None = None
        self._inserted: Callable[[int, int], None] | None = None
        self._pending_bytes = 0
        self._in_flight = 0
        self._space = trio.lowlevel.ParkingLot()
        self._idle = trio.lowlevel.ParkingLot()
        self._buffer_started = trio.lowlevel.ParkingLot()
        self._nursery: trio.Nursery | None = None
        self._closing = False
        self._stopped = trio.Event()
        self._waiting: set[trio.CancelScope] = set()  # inserts flush(within=) may abandon
        #: Per table, the order its blocks may start in (see TableOrder).
        self._order = {n: TableOrder(self.batching.inserts_in_flight) for n in self.tables}
        #: Tables with a block handed to the owner (its repeat comes from the
        #: spool): their later blocks are handed over untried, until nothing of
        #: the table is left here (the owner's new batches follow the spool).
        self._handing_over: set[str] = set()
        self._waited = 0.0
        #: Set while :meth:`hand_over_unfinished` takes the blocks over.
        self._yielding = False
        #: Per table, attempts this sink stopped waiting for that still run in
        #: their threads: an owner's repeat (``insert_now``) waits for them.
        self._abandoned_running: dict[str, int] = {n: 0 for n in self.tables}
        self._attempts_returned = trio.lowlevel.ParkingLot()
        self._trio_token: trio.lowlevel.TrioToken | None = None
        #: Since when (epoch seconds) and why inserts fail transiently (the
        #: server unreachable, its disk read-only): until one succeeds.
        self._unreached: tuple[float, str] | None = None

    # -- construction helpers ---------------------------------------------

    @classmethod
    def embedded(
        cls, schema: RecordSchema, path: str | Path = "taproute-data", **kwargs: Any
    ) -> ClickHouseSink:
        """A sink on chDB persisted to ``path`` (tables created by default).

        ``scratch_inserts=True`` hands blocks to chDB as in-memory Arrow files
        read without the GIL, instead of through ``Python()``
        (:class:`ChdbTransport`); the other keywords are the sink's."""
        expect_schema(schema, "ClickHouseSink.embedded(schema, path, ...)")
        kwargs.setdefault("create_tables", True)
        transport = ChdbTransport(path, scratch_inserts=kwargs.pop("scratch_inserts", None))
        return cls._owning(transport, schema, kwargs)

    @classmethod
    def server(cls, schema: RecordSchema, client_or_url: Any, **kwargs: Any) -> ClickHouseSink:
        """A sink on a ClickHouse server, from a clickhouse-connect client or URL
        (``when_unreachable="check_later"``: see :class:`ClickHouseSink`)."""
        expect_schema(schema, "ClickHouseSink.server(schema, client_or_url, ...)")
        later = kwargs.get("when_unreachable") == "check_later"
        return cls._owning(ServerTransport(client_or_url, connect=not later), schema, kwargs)

    @classmethod
    def _owning(
        cls, transport: Transport, schema: RecordSchema, kwargs: dict[str, Any]
    ) -> ClickHouseSink:
        try:
            return cls(transport, schema, **kwargs)
        except BaseException:  # also a bad keyword, raised before __init__ runs
            transport.close()
            raise

    def use_hooks(self, hooks: HookRegistry) -> None:
        """Name raw records' hooks from ``hooks`` (the runtime or routing sink hands it
        over once, before the first batch; see :class:`~taproute.routing.sink.NamesHooks`)."""
        if self.hooks is not None and self.hooks is not hooks:
            raise ConfigError("ClickHouseSink is already attached to another HookRegistry")
        self.hooks = hooks

    # -- lifecycle ------------------------------------------------------------

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Host the linger timer and the insert tasks until :meth:`close`."""
        if self._nursery is not None:
            raise RuntimeError("ClickHouseSink.run() can only be started once")
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self._trio_token = trio.lowlevel.current_trio_token()
                nursery.start_soon(self._linger_timer)
                task_status.started()
                await self._stopped.wait()
                nursery.cancel_scope.cancel()  # only the timer is left: close drained inserts
        finally:
            if not self._closing:  # cancelled from outside (a shutdown's cut): given up
                self._drop_buffers(given_up=True)
            self._stopped.set()

    def _drop_buffers(self, *, given_up: bool) -> None:
        """Give back the buffers of the rows still buffered (no insert will
        take them) and forget the rows; ``given_up``: count them as
        abandoned (the run task was cancelled) and their bytes as no longer
        pending."""
        for table, buffer in self._buffers.items():
            counters = self.counters[table]
            counters.buffered_rows -= buffer.rows
            if given_up:
                counters.abandoned_rows += buffer.rows
                self._pending_bytes -= buffer.bytes
            for hold in buffer.holds:
                hold.release()
        self._buffers = {n: TableBuffer() for n in self.tables}

    @property
    def running(self) -> bool:
        """True between the start of :meth:`run` and :meth:`close`."""
        return self._nursery is not None and not self._stopped.is_set()

    @property
    def flush_timeout(self) -> float:
        """How long an owner's flush waits for inserts in flight before it
        takes their blocks over (``FlushesWithin``): :attr:`close_timeout`."""
        return self.close_timeout

    async def _linger_timer(self) -> None:
        while True:
            due = min((b.first_at for b in self._buffers.values()), default=math.inf)
            if due == math.inf:
                await self._buffer_started.park()
                continue
            due += self.batching.linger
            if trio.current_time() < due:
                with trio.move_on_at(due):
                    await self._buffer_started.park()
                continue
            for table, buffer in self._buffers.items():
                if buffer.first_at + self.batching.linger <= trio.current_time():
                    self._seal(table)

    # -- RecordSink -----------------------------------------------------------

    async def submit(self, batch: Batch) -> None:
        """Buffer ``batch`` for its table; waits while too much is buffered."""
        self._latch.raise_if_failed()
        if self._closing:
            raise SinkClosed("ClickHouseSink is closed")
        if self._nursery is None:
            raise RuntimeError("ClickHouseSink is not running: start its run() task first")
        while self._pending_bytes >= self.batching.max_buffered_bytes:
            # Only an insert finishing makes room: make sure one will.
            self._seal_idle_tables()
            await self._space.park()
            self._latch.raise_if_failed()
        for table, part in self._by_table(batch):
            self._add(table, part, None if isinstance(part, RowBatch) else part.retain())

    def _by_table(self, batch: Batch) -> list[tuple[str, Batch]]:
        return split_by_table(batch, self._raw, self._rows, self.schema)

    def _add(self, table: str, batch: Batch, hold: Retained | None) -> None:
        buffer = self._buffers[table]
        if not buffer.items:
            buffer.first_at = trio.current_time()
            self._buffer_started.unpark_all()
        buffer.items.append(batch)
        if hold is not None:
            buffer.holds.append(hold)
        buffer.rows += len(batch)
        buffer.bytes += batch.nbytes
        self._pending_bytes += batch.nbytes
        counters = self.counters[table]
        counters.buffered_rows += len(batch)
        inserting = counters.in_flight_rows > 0
        if seal_due(buffer.rows, buffer.bytes, self.batching, inserting=inserting):
            self._seal(table)

    def _seal_idle_tables(self) -> None:
        """Seal the buffer of every table none of whose inserts runs.

        A producer waiting for room (``max_buffered_bytes``) waits for an
        insert to finish; with ``max_buffered_bytes`` below ``max_bytes`` and
        no early seal, buffers could hold all of it with nothing in flight,
        and the wait would last until the linger sealed them.
        """
        for table, buffer in self._buffers.items():
            if buffer.items and self.counters[table].in_flight_rows == 0:
                self._seal(table)

    def _seal(self, table: str) -> None:
        """Hand the table's buffer to an insert task."""
        buffer = self._buffers[table]
        if not buffer.items:
            return
        self._buffers[table] = TableBuffer()
        counters = self.counters[table]
        counters.buffered_rows -= buffer.rows
        counters.in_flight_rows += buffer.rows
        self._block_seq += 1
        token = f"{self._token_prefix}-{self._block_seq}"
        self._in_flight += 1
        assert self._nursery is not None
        self._nursery.start_soon(self._insert, table, buffer, token, self._order[table].seal())

    async def _insert(self, table: str, buffer: TableBuffer, token: str, index: int) -> None:
        counters = self.counters[table]
        attempt = HeldAttempt(buffer.holds, lambda: self._attempt_returned(table))
        scope = trio.CancelScope()  # cancelled when flush(within=) stops waiting
        self._waiting.add(scope)
        try:
            with scope:
                failed = await self._attempts(table, buffer, token, attempt, index)
            if scope.cancelled_caught:
                failed = (self._stopped_waiting_error(table, buffer, token, attempt), 0)
            if failed is None:
                return
            exc, failures = failed
            if self._failed_blocks is not None:
                self._handing_over.add(table)
                if failures and not self.transport.is_transient(exc):
                    # Refused (nothing written): behind the blocks tried
                    # beside it, whose repeats must not wait for its splits.
                    index = self._order[table].requeue(index)
                # In the table's order: the owner spools (and repeats) the
                # table's blocks as they were sealed, so no block handed over
                # later, untried, is inserted before an earlier one's repeat.
                await self._order[table].wait_turn(index, behind_all=True)
                await self._hand_over(table, buffer, token, exc)
            elif isinstance(exc, InsertAbandoned):
                counters.abandoned_rows += buffer.rows
                self._latch.latch(exc, destination=f"clickhouse table {table!r}", where="close")
            else:
                counters.abandoned_rows += buffer.rows  # taken, and lost: given up
                self._latch.latch(
                    exc,
                    destination=f"clickhouse table {table!r}",
                    where=(
                        f"insert of {buffer.rows} rows into {self.transport.description} "
                        f"after {failures} attempt(s)"
                    ),
                )
        except trio.Cancelled:  # the run task cancelled (a shutdown's cut): given up
            counters.abandoned_rows += buffer.rows
            raise
        finally:
            self._waiting.discard(scope)
            counters.in_flight_rows -= buffer.rows
            if counters.in_flight_rows == 0 and counters.buffered_rows == 0:
                self._handing_over.discard(table)
            self._order[table].done(index)
            self._pending_bytes -= buffer.bytes
            # The buffers go back now, or when an abandoned attempt returns.
            if attempt.finish():
                self._abandoned_running[table] += 1
            self._in_flight -= 1
            self._space.unpark_all()
            if self._in_flight == 0:
                self._idle.unpark_all()

    async def _attempts(
        self, table: str, buffer: TableBuffer, token: str, attempt: HeldAttempt, index: int
    ) -> tuple[Exception, int] | None:
        """Insert the block (the table's ``index``-th), in its turn, retrying
        transient failures within ``retry`` (an owner takes the first failure
        instead, and the table's later blocks untried, in order, until
        nothing of it is left here); None once it is written, else the last
        error and the attempts made."""
        await self._order[table].wait_turn(index)
        if table in self._handing_over:
            return HeldBack(table, token), 0  # spooled after every earlier one (_insert)
        async with self._limiters[table]:
            attempt.tried = True
            return await self._attempt_until_done(table, buffer, token, attempt)

    async def _attempt_until_done(
        self, table: str, buffer: TableBuffer, token: str, attempt: HeldAttempt
    ) -> tuple[Exception, int] | None:
        """:meth:`_attempts` once the block may start: the tries themselves."""
        counters = self.counters[table]
        failures = 0
        while True:
            try:
                # Abandoned when flush(within=) stops waiting, or when the
                # server stopped answering (liveness.py): the attempt then
                # gives the producers' buffers back itself.
                await run_watched(
                    self.transport,
                    self._calls.call,
                    attempt.run,
                    self._insert_blocking,
                    table,
                    buffer,
                    token,
                )
            except Exception as exc:
                failures += 1
                counters.errors += 1
                if self.transport.is_transient(exc):  # unhealthy until an insert succeeds
                    since = time.time() if self._unreached is None else self._unreached[0]
                    self._unreached = (since, self.describe_failure(exc))
                if (
                    self._failed_blocks is None
                    and failures < self.retry.attempts
                    and self.transport.is_transient(exc)
                ):
                    counters.retries += 1
                    await trio.sleep(self.retry.backoff(failures))
                    continue
                if self._failed_blocks is not None:
                    self._handing_over.add(table)  # before anyone waiting wakes
                return exc, failures
            self._unreached = None
            counters.inserts += 1
            counters.records += buffer.rows
            counters.bytes += buffer.bytes
            if self._inserted is not None:
                self._inserted(buffer.rows, len(buffer.items))
            return None

    def _stopped_waiting_error(
        self, table: str, buffer: TableBuffer, token: str, attempt: HeldAttempt
    ) -> Exception:
        """Why a block this sink stopped waiting for is handed over (or given up)."""
        if self._failed_blocks is not None:
            if self._yielding:
                return Yielded(table, token, tried=attempt.tried)
            if not attempt.tried:
                return HeldBack(table, token)
        return self._abandoned_error(table, buffer)

    def _attempt_returned(self, table: str) -> None:
        """In an abandoned attempt's thread, when it returns: tell the loop."""
        token = self._trio_token
        if token is None:
            return
        with contextlib.suppress(trio.RunFinishedError):  # the loop is gone: nobody waits
            token.run_sync_soon(self._abandoned_returned, table)

    def _abandoned_returned(self, table: str) -> None:
        self._abandoned_running[table] -= 1
        self._attempts_returned.unpark_all()

    async def hand_over_unfinished(self) -> None:
        """Hand every block not written yet to the owner now, each table's in
        its order, under its token: for an owner about to spool batches
        behind them (see ``SpoolingSink``), so that a block whose outcome is
        unknown is repeated before anything spooled after it.  Buffered rows
        are sealed and handed over untried; an insert running is not
        waited for (:class:`Yielded`): it runs on in its thread, and the
        owner's repeat waits for it (:meth:`insert_now`).  Returns once
        nothing is left here; nothing to do returns at once."""
        if self._failed_blocks is None:
            raise RuntimeError("hand_over_unfinished() needs hand_over_failures() first")
        if not self._in_flight and not any(b.items for b in self._buffers.values()):
            return
        for table in list(self._buffers):
            self._seal(table)
        self._handing_over.update(t for t, c in self.counters.items() if c.in_flight_rows)
        self._yielding = True
        try:
            for scope in list(self._waiting):
                scope.cancel()
            while self._in_flight:
                await self._idle.park()
        finally:
            self._yielding = False

    def _abandoned_error(self, table: str, buffer: TableBuffer) -> InsertAbandoned:
        kept = (
            "handed to the spool, to be repeated under the same deduplication token"
            if self._failed_blocks is not None
            else "not known to be written"
        )
        return InsertAbandoned(
            f"no answer within {self._waited:g} s (close_timeout): stopped waiting for the "
            f"insert of {buffer.rows} rows into table {table!r} at "
            f"{self.transport.description}; {kept}"
        )

    def _insert_blocking(self, table: str, buffer: TableBuffer, token: str) -> None:
        """Runs in a worker thread: build the Arrow table and insert it
        (deduplication token: ``token`` and the table's name); tables left
        unchecked at construction are checked first."""
        if not self._checks.done:
            self._checks.when_reached()
        data = block_table(
            buffer.items, self.tables[table], self.schema, self.hooks, self._hook_dictionary
        )
        allowance = self._checks.allowance.get(table)
        try:
            self.transport.insert(
                table,
                data,
                dedup_token=f"{token}-{table}",
                settings=None if allowance is None else allowance.settings,
            )
        except Exception as exc:
            if allowance is None or not too_many_partitions(exc):
                raise
            raise self._too_many_partitions(table, data.num_rows, allowance) from exc

    def _too_many_partitions(
        self, table: str, rows: int, allowance: PartitionAllowance
    ) -> TooManyPartitions:
        window, inserts, allowed = (
            self._checks.windows[table],
            self._checks.inserts,
            allowance.partitions,
        )
        limit = (
            f"this server's max_partitions_per_insert_block = {allowed} (lower than "
            f"{window.setting} = {window.size} over {inserts} insert(s) allows)"
            if allowance.capped
            else (
                f"whose {window.setting} = {window.size} holds {allowed} per insert for the "
                f"{inserts} insert(s) that may land between a first try and its repeat "
                f"(2 x inserts_in_flight - 1, inserts_in_flight = "
                f"{self.batching.inserts_in_flight})"
            )
        )
        need = (
            "raise the server's max_partitions_per_insert_block"
            if allowance.capped
            else (
                f"the window needs {inserts} x the partitions one insert touches, at least "
                f"{inserts * (allowed + 1)}: ALTER TABLE `{table}` MODIFY SETTING "
                f"{window.setting} = N"
            )
        )
        return TooManyPartitions(
            f"an insert of {rows} rows touches more than {allowed} partition(s) of table "
            f"{table!r} at {self.transport.description}, {limit}: ClickHouse remembers a block "
            "per partition an insert touches, and a repeated block that left the window is "
            f"written twice. Nothing of it was written. To insert it, {need}; or insert fewer "
            "rows at once (Batching max_rows / max_bytes, fewer inserts_in_flight)"
        )

    async def flush(self, *, within: float | None = None) -> None:
        """Insert everything buffered; return once every insert is done, or raise.

        ``within`` (seconds) bounds the wait: inserts still running (or
        retrying) then are abandoned, their threads left to end within the
        transport's timeouts; an owner takes their blocks (see
        :meth:`hand_over_failures`), else their rows are counted as
        ``abandoned_rows`` and :class:`InsertAbandoned` is latched and raised."""
        self._latch.raise_if_failed()
        if self._nursery is None:
            raise RuntimeError("ClickHouseSink is not running: start its run() task first")
        for table in list(self._buffers):
            self._seal(table)
        if within is not None:
            with trio.move_on_after(within):
                while self._in_flight:
                    await self._idle.park()
            if self._in_flight:
                self._waited = within
                for scope in list(self._waiting):
                    scope.cancel()
        while self._in_flight:
            await self._idle.park()
        self._latch.raise_if_failed()

    async def close(self) -> None:
        """Flush, waiting at most ``close_timeout`` seconds (see :meth:`flush`),
        stop the background task, release the transport; idempotent.  A
        close cancelled while it waits still releases the transport (once
        the inserts it stopped waiting for returned, never under one)."""
        if self._closing:
            await self._stopped.wait()
            return
        try:
            if self._nursery is not None:
                await self.flush(within=self.close_timeout)
        finally:
            self._closing = True
            self._stopped.set()
            # Rows are only left after a failure (the flush raised it before
            # sealing them): taken and never inserted, so given up, counted.
            self._drop_buffers(given_up=True)
            # Closed now, or by the last call abandoned (an insert close
            # stopped waiting for, an owner's insert_now or check_tables)
            # once it returns.  Also when close was cancelled (it never
            # started before: the transport stayed open); waited for at
            # most RELEASE_WITHIN_S, after which it goes on in its thread.
            with trio.move_on_after(RELEASE_WITHIN_S, shield=True):
                await trio.to_thread.run_sync(self._calls.close, abandon_on_cancel=True)

    @property
    def calls_running(self) -> int:
        """Blocking calls on the transport running now (abandoned ones included)."""
        return self._calls.running

    def release_transport(self, timeout: float | None = None) -> int:
        """For an owner that inserts through :meth:`insert_now` and never ran
        this sink (the writer process): refuse later calls and close the
        transport (if owned) once no call runs, waiting (blocking) up to
        ``timeout`` seconds for calls still running, such as an insert its
        caller abandoned; never closes it under one.  Returns how many calls
        were running when it was called (0: closed at once)."""
        running = self.calls_running
        self._calls.close()
        self._calls.wait_released(timeout)
        return running

    async def release_when_cut(self) -> None:
        """A shutdown's cut cancelled the run task and this sink will not be
        closed: refuse later calls and close the transport (if owned) now,
        or once the last call running returns (an insert the cut abandoned
        in its thread); never waits.  Without it the chDB session stayed open
        (no other data directory could be opened in the process) and a
        server's client kept its connections."""
        self._closing = True
        self._calls.close()

    # -- tables checked when the server is first reached -------------------

    @property
    def tables_checked(self) -> bool:
        """Every table was checked (always, unless built ``check_later`` while
        the server could not be reached)."""
        return self._checks.done

    @property
    def unchecked_reason(self) -> str | None:
        """Why the tables are not checked yet, for the owner's health report."""
        return self._checks.waiting_reason

    @property
    def check_failure(self) -> Exception | None:
        """A table that did not fit when the server was first reached, or None."""
        return self._checks.failure

    def check_tables(self) -> None:
        """Check the tables left unchecked (blocking; see :class:`TableChecks`).
        The owner may abandon the call (its thread) at close: the transport
        is closed only once it returned."""
        self._calls.call(self._checks.when_reached)

    # -- observation ----------------------------------------------------------

    @property
    def failure(self) -> BaseException | None:
        """The latched failure, or None."""
        return self._latch.failure

    def reach(self) -> Reach:
        """Unhealthy from an insert's transient failure (retried, or handed to
        an owner) until an insert succeeds; healthy otherwise (``ReportsReach``:
        the health of a destination without a spool)."""
        unreached = self._unreached
        if unreached is None:
            return Reach(healthy=True)
        return Reach(healthy=False, unhealthy_since=unreached[0], reason=unreached[1])

    def given_up_records(self) -> int:
        """Rows this sink took and gave up, over all tables (``abandoned_rows``):
        an insert close stopped waiting for, or the run task cancelled (a
        shutdown's cut) with rows buffered or being inserted."""
        return sum(c.abandoned_rows for c in self.counters.values())

    def insert_errors(self) -> int:
        """Insert attempts that failed, retried or not, over all tables
        (``CountsInsertErrors``)."""
        return sum(c.errors for c in self.counters.values())

    def table_counters(self) -> dict[str, TableCounters]:
        """A detached copy of every table's counters."""
        return {name: attrs.evolve(c) for name, c in self.counters.items()}

    def query(self, sql: str) -> pa.Table:
        """Run a query on the same ClickHouse (blocking; for tests, notebooks, the CLI)."""
        return self.transport.query(sql)
