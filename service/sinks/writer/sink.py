"""WriterProcessSink: a ClickHouse destination whose inserts run in a writer
process, so chDB's work (Arrow conversion, ``Connection.query``, which holds
the GIL) never takes the model process's GIL, and a crashing destination
never takes the model process down.

The model process keeps what is cheap: it buffers batches like
:class:`~taproute.service.sinks.clickhouse.ClickHouseSink` (rows, bytes,
linger), seals a buffer into a *block* with a deduplication token, and sends
the block's descriptors and payload *references* to the writer.  Payloads
stay where the capture hook wrote them when that is a
:class:`~.shared_pool.SharedBufferPool` buffer (``bind_modules(...,
pool=sink.buffer_pool)``); a batch whose payload lies elsewhere is copied
once into the pool (counted as ``copied_bytes``).  A block's buffers go back
to the producer when the writer says it is persisted.

Sealed blocks go to the writer in order (``TableOrder``, as in-process:
block ``i`` once every block before ``i - inserts_in_flight + 1`` is done),
so a block's repeat (a retry, a re-send after the writer died) lands behind
at most ``2 x inserts_in_flight - 1`` inserts, what the writer checked each
table's deduplication window holds.

Failure: an insert error the writer reports as transient is retried with the
same token (``Retry``); another, or the retry budget spent, latches the
failure (raised by the next ``submit``/``flush``/``close``), like the
in-process sink.  A writer that dies (crash, SIGKILL) is detected by its
socket ending, counted (``crashes``), reported (``health``), and restarted
with every unfinished block re-sent under its token, so nothing is lost and
nothing is written twice; after ``restarts`` deaths in a row without a
persisted block the failure is latched instead.

This module holds the sink's face (buffering, flush, close, ``insert_now``,
reading); the talk with the writer process and its supervision live in
:mod:`.conversation`, what a batch sends in :mod:`.payloads`, the blocks,
queries and counters tracked in :mod:`.blocks`, reading once the writer is
gone in :mod:`.reading`, ``embedded``/``server`` keywords in :mod:`.options`.
"""

from __future__ import annotations

import itertools
import math
import uuid
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import trio

from taproute.routing.batch import Batch
from taproute.routing.errors import ConfigError, SinkClosed
from taproute.routing.hooks import HookRegistry
from taproute.routing.latch import FailureLatch
from taproute.routing.schema import RecordSchema
from taproute.service.sinks.clickhouse.batching import Batching, Retry, seal_due
from taproute.service.sinks.clickhouse.blocks import TableOrder
from taproute.service.sinks.writer.blocks import (
    HELD,
    Block,
    PendingQuery,
    WriterCounters,
    WriterHealth,
)
from taproute.service.sinks.writer.conversation import WriterConversation
from taproute.service.sinks.writer.errors import WriterCrashed, WriterInsertFailed
from taproute.service.sinks.writer.options import writer_config
from taproute.service.sinks.writer.payloads import batch_item
from taproute.service.sinks.writer.process import WriterProcess
from taproute.service.sinks.writer.protocol import Query, RawItem, RowItem, WriterConfig
from taproute.service.sinks.writer.reading import answer_table, query_locally
from taproute.service.sinks.writer.shared_pool import SharedBufferPool

__all__ = ["WriterCounters", "WriterHealth", "WriterProcessSink"]


class WriterProcessSink(WriterConversation):
    """A :class:`~taproute.routing.sink.RecordSink` writing to ClickHouse from a
    writer process (see the module docstring).

    Takes :class:`ClickHouseSink`'s table arguments (``raw``, ``rows``,
    ``create_tables``, ``raw_table``, ``rows_table``,
    ``require_deduplication``), ``batching`` and ``retry``; tables are checked
    (and created) by the writer at construction, and its errors
    (``SchemaMismatch``, ``MissingTable``, ``NoDeduplication``) are raised
    here.  ``restarts``: writer deaths in a row (without a persisted block in
    between) that are answered with a restart; one more latches.
    ``nice`` (``embedded``/``server``, 0 to 19, default 0): added to the
    writer process's scheduling niceness, every thread of it, restarts
    included.  Where the model's threads and the writer want more cores
    than there are, the kernel then runs the model's first, and the writer
    in what is left (its backlog meanwhile is bounded by the sink's buffer,
    then by the runtime's blocking budget and its shedding, counted).

    Reading the tables: :meth:`query` goes through the writer while it runs
    (chDB lets one process at a time open a directory, and the writer has
    it), and opens the directory in this process once the sink is closed.
    """

    def __init__(
        self,
        config: WriterConfig,
        *,
        hooks: HookRegistry | None = None,
        batching: Batching | None = None,
        retry: Retry | None = None,
        restarts: int = 3,
        pool: SharedBufferPool | None = None,
        start_timeout: float = 120.0,
        flush_timeout: float = 10.0,
    ) -> None:
        if restarts < 0:
            raise ConfigError(f"WriterProcessSink restarts must be >= 0, got {restarts}")
        self.config = config
        self.schema: RecordSchema = config.schema
        self.hooks = hooks
        self.batching = batching or Batching()
        self.retry = retry or Retry()
        self.restarts = restarts
        self.start_timeout = start_timeout
        if not (
            isinstance(flush_timeout, (int, float))
            and not isinstance(flush_timeout, bool)
            and 0 <= flush_timeout < math.inf
        ):
            raise ConfigError(f"flush_timeout must be seconds >= 0, got {flush_timeout!r}")
        #: Seconds an owner's flush (a spool's) waits for the writer's inserts
        #: before it takes their blocks over (``flush(within=)``).  Not a bound
        #: on :meth:`close` (a hung writer is killed at the shutdown's grace).
        self.flush_timeout = float(flush_timeout)
        self._raw_ids = self._raw_layouts(config)
        #: The tables written (checked, or created, by the writer).
        self.tables: tuple[str, ...] = tuple(
            sorted(
                {config.raw_table.format(layout=name) for name in config.raw}
                | {config.rows_table.format(layout=name) for name in config.rows}
            )
        )
        self._row_layouts = frozenset(config.rows)
        for name in config.rows:
            self.schema.layout(name)
        if not self._raw_ids and not self._row_layouts:
            raise ConfigError(
                "WriterProcessSink needs raw=[payload layouts] and/or rows=[output layouts]"
            )
        self.buffer_pool = pool or SharedBufferPool()
        self._owns_pool = pool is None
        try:
            self._process: WriterProcess | None = WriterProcess.start(config, start_timeout)
        except BaseException:
            if self._owns_pool:
                self.buffer_pool.close()
            raise
        self.counters = WriterCounters()
        self._health = WriterHealth(True, None, None)
        self._latch = FailureLatch()
        self._token_prefix = uuid.uuid4().hex
        self._ids = itertools.count(1)
        self._buffer = Block(0, "")
        self._buffer_started_at = math.inf
        self._blocks: dict[int, Block] = {}
        #: The order sealed blocks go to the writer in (each inserts at most
        #: once into each table, so one order for them all bounds every
        #: table's): block i once every block before i - inserts_in_flight + 1
        #: is done, so at most 2 x inserts_in_flight - 1 inserts land between
        #: a block's first try and its repeat (a retry, or a re-send after
        #: the writer died), what the writer checked each window holds.
        self._order = TableOrder(config.inserts_in_flight)
        self._unsent: deque[Block | PendingQuery] = deque()
        self._queries: dict[int, PendingQuery] = {}
        self._pending_bytes = 0
        self._abandoned: dict[int, list[object]] = {}
        self._handing_over = False
        self._crashes_in_a_row = 0
        self._wake_sender = trio.lowlevel.ParkingLot()
        self._space = trio.lowlevel.ParkingLot()
        self._idle = trio.lowlevel.ParkingLot()
        self._buffer_started = trio.lowlevel.ParkingLot()
        self._failed_blocks = None
        self._inserted = None
        self._nursery: trio.Nursery | None = None
        self._trio_token: trio.lowlevel.TrioToken | None = None
        self._closing = False
        self._stopped = trio.Event()
        self._run_done = trio.Event()  # run() returned: no supervisor, no writer it started

    @staticmethod
    def _raw_layouts(config: WriterConfig) -> frozenset[int]:
        for name in config.raw:
            config.schema.layout(name).check_payload_layout()
        return frozenset(config.schema.layout_id(name) for name in config.raw)

    # -- construction -------------------------------------------------------------

    @classmethod
    def embedded(
        cls, schema: RecordSchema, path: str | Path = "taproute-data", **kwargs: Any
    ) -> WriterProcessSink:
        """A writer process on chDB persisted to ``path`` (tables created by default)."""
        return cls(writer_config("chdb", str(Path(path).resolve()), schema, kwargs), **kwargs)

    @classmethod
    def server(cls, schema: RecordSchema, url: str, **kwargs: Any) -> WriterProcessSink:
        """A writer process inserting into a ClickHouse server at ``url``."""
        kwargs.setdefault("create_tables", False)
        return cls(writer_config("server", url, schema, kwargs), **kwargs)

    def use_hooks(self, hooks: HookRegistry) -> None:
        """Name raw records' hooks from ``hooks`` (see ``NamesHooks``)."""
        if self.hooks is not None and self.hooks is not hooks:
            raise ConfigError("WriterProcessSink is already attached to another HookRegistry")
        self.hooks = hooks

    @property
    def writer_pid(self) -> int | None:
        """The writer process's pid now (None once stopped)."""
        return None if self._process is None else self._process.pid

    # -- lifecycle -------------------------------------------------------------

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Host the writer's supervisor, sender and linger timer until :meth:`close`."""
        if self._nursery is not None:
            raise RuntimeError("WriterProcessSink.run() can only be started once")
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self._trio_token = trio.lowlevel.current_trio_token()
                nursery.start_soon(self._linger_timer)
                nursery.start_soon(self._supervise)
                task_status.started()
                await self._stopped.wait()
                nursery.cancel_scope.cancel()
        finally:
            # Cancelled before close() finished (a shutdown's grace ran out):
            # the writer, in a session of its own, would outlive this loop.
            self._kill_writer()
            self._stopped.set()
            self._run_done.set()

    async def release_when_cut(self) -> None:
        """Stop the writer process now and give back the shared pool when
        owned (see ``ReleasesWhenCut``): for a sink a shutdown's cut
        cancelled, or one whose :meth:`run` never started (another
        destination failed to open first), whose writer would otherwise
        outlive the failure.  Nothing is delivered after it: what was
        buffered or in flight is dropped (a never-run sink holds none).
        Idempotent; later calls are refused as after :meth:`close`."""
        self._kill_writer()
        self._closing = True
        self._stopped.set()
        if self._owns_pool:
            self.buffer_pool.close()

    def _kill_writer(self) -> None:
        """Kill the writer process still running, if any, and give back what
        this sink holds (run() ended without a close: what was buffered or
        in flight is lost).  Blocking for the reap only (SIGKILL)."""
        process, self._process = self._process, None
        if process is None:
            return
        self._closing = True
        process.kill()
        process.close_sockets()
        self._drop_unsent()

    def _drop_unsent(self) -> None:
        """The writer is gone: settle what waited on it, give the buffered
        block's buffers back and forget its rows and bytes."""
        self._finish_all(None)
        self._drop_buffer()
        self._pending_bytes = 0

    @property
    def running(self) -> bool:
        """True between the start of :meth:`run` and :meth:`close`."""
        return self._nursery is not None and not self._stopped.is_set()

    async def _linger_timer(self) -> None:
        while True:
            if self._buffer_started_at == math.inf:
                await self._buffer_started.park()
                continue
            due = self._buffer_started_at + self.batching.linger
            if trio.current_time() < due:
                with trio.move_on_at(due):
                    await self._buffer_started.park()
                continue
            self._seal()

    # -- RecordSink --------------------------------------------------------------

    async def submit(self, batch: Batch) -> None:
        """Buffer ``batch``; waits while too much is buffered or in flight."""
        self._check_open()
        while self._pending_bytes >= self.batching.max_buffered_bytes:
            # Only a block persisted makes room: make sure one is on its way
            # (with max_buffered_bytes below max_bytes and no early seal, the
            # buffer could hold all of it with no block at the writer, and the
            # wait would last until the linger sealed it).
            if not self._blocks:
                self._seal()
            await self._space.park()
            self._latch.raise_if_failed()
        if len(batch) == 0:
            return
        item, hold = self._item(batch)
        buffer = self._buffer
        if not buffer.items:
            self._buffer_started_at = trio.current_time()
            self._buffer_started.unpark_all()
        buffer.items.append(item)
        if self._failed_blocks is not None:
            buffer.batches.append(batch)
        if hold is not None:
            buffer.holds.append(hold)
        buffer.rows += len(batch)
        buffer.nbytes += batch.nbytes
        self._pending_bytes += batch.nbytes
        self.counters.buffered_rows += len(batch)
        if seal_due(buffer.rows, buffer.nbytes, self.batching, inserting=bool(self._blocks)):
            self._seal()

    def _check_open(self) -> None:
        self._latch.raise_if_failed()
        if self._closing:
            raise SinkClosed("WriterProcessSink is closed")
        if self._nursery is None:
            raise RuntimeError("WriterProcessSink is not running: start its run() task first")

    def _item(self, batch: Batch) -> tuple[RawItem | RowItem, Any]:
        return batch_item(
            batch,
            pool=self.buffer_pool,
            schema=self.schema,
            raw_ids=self._raw_ids,
            row_layouts=self._row_layouts,
            counters=self.counters,
        )

    def _seal(self) -> None:
        """Make the buffer a block and queue it for the writer."""
        buffer = self._buffer
        self._buffer_started_at = math.inf
        if not buffer.items:
            return
        block_id = next(self._ids)
        buffer.id, buffer.token = block_id, f"{self._token_prefix}-{block_id}"
        self._buffer = Block(0, "")
        self.counters.buffered_rows -= buffer.rows
        self.counters.in_flight_rows += buffer.rows
        self._blocks[block_id] = buffer
        buffer.index, buffer.state = self._order.seal(), HELD
        assert self._nursery is not None
        self._nursery.start_soon(self._send_in_turn, buffer)

    async def flush(self, *, within: float | None = None) -> None:
        """Send everything buffered; return once the writer has persisted it all, or raise.

        ``within`` (seconds; only where an owner takes failed blocks over, see
        :meth:`hand_over_failures`) bounds the wait for the writer: blocks of
        the batched path it has not persisted then (a writer hung in an
        insert, or stopped) are handed to the owner under their tokens, as
        after a death, and the flush returns once the owner has them."""
        self._check_open()
        self._seal()
        if within is not None and self._failed_blocks is not None:
            with trio.move_on_after(within):
                while self._own_blocks():
                    await self._idle.park()
            if self._own_blocks():
                self._stop_waiting(within)
            while self._own_blocks():
                await self._idle.park()
        else:
            while self._blocks:
                await self._idle.park()
        self._latch.raise_if_failed()

    async def close(self) -> None:
        """Flush, stop the writer process, release the pool; idempotent.

        Returns once no writer process this sink started runs (a replacement
        starting after a crash is stopped and reaped first).  Cancelled (its
        owner's shutdown grace ran out), it kills the writer at once; so does
        :meth:`run` cancelled before a close finished."""
        if self._closing:
            await self._stopped.wait()
            return
        try:
            if self._nursery is not None:
                await self.flush()
        finally:
            self._closing = True
            await self._stop_process()
            self._stopped.set()
            if self._nursery is not None:
                # A replacement writer starting now is stopped by the supervisor
                # (it sees _closing); close returns once it has been.
                await self._run_done.wait()
            self._drop_unsent()
            if self._owns_pool:
                self.buffer_pool.close()

    def close_unstarted(self) -> None:
        """Stop the writer of a sink whose :meth:`run` never started (blocking;
        what ``taproute check`` does after the writer checked the tables)."""
        if self._nursery is not None:
            raise RuntimeError("WriterProcessSink is running: close it on its loop (close())")
        if self._closing:
            return
        self._closing = True
        process, self._process = self._process, None
        if process is not None:
            process.send_close_blocking()
            process.stop(30.0)
            process.close_sockets()
        self._stopped.set()
        if self._owns_pool:
            self.buffer_pool.close()

    async def hand_over_unfinished(self) -> None:
        """Hand every block of the batched path not persisted yet to the owner
        now, in order, under its token: for an owner about to spool batches
        behind them (see ``SpoolingSink``), so that a block whose outcome is
        unknown is repeated before anything spooled after it.  The buffer is
        sealed and handed over untried; a block the writer has is not waited
        for (it keeps its buffers until the writer answers for it, and the
        owner's repeat waits for that answer: :meth:`insert_now`).  Returns
        once none is left here; nothing to do returns at once."""
        if self._failed_blocks is None:
            raise RuntimeError("hand_over_unfinished() needs hand_over_failures() first")
        if not self._buffer.items and not self._own_blocks():
            return
        self._seal()
        self._take_over_unfinished(
            lambda block: WriterInsertFailed(
                "handed to the spool before its outcome was known (the destination's batches "
                "are being spooled, and this block is repeated first): insert of "
                f"{block.rows} rows into {self.config.where}, block {block.token}",
                transient=False,
            )
        )
        while self._own_blocks():
            await self._idle.park()

    # -- insert_now (for a spool wrapping this sink) ---------------------------------

    async def insert_now(self, batches: Sequence[Batch], token: str) -> None:
        """Insert ``batches`` as one block with ``token``; no buffering, no retry.

        Raises the writer's failure (:meth:`is_transient` says whether the same
        call may succeed later); a writer death during the call is transient.
        Waits first while the writer still has a block this sink handed to
        the owner without its answer (:meth:`hand_over_unfinished`, a flush's
        ``within``): that try may still land, and a repeat of it, or
        anything after it, must not land first, or the try could land with
        its block gone from the deduplication window.
        """
        self._check_open()
        while self._abandoned:
            await self._idle.park()
            self._check_open()
        block = Block(next(self._ids), token)
        outcome: list[BaseException | None] = []
        block.waiter = outcome
        for batch in batches:
            if len(batch):
                item, hold = self._item(batch)
                block.items.append(item)
                if hold is not None:
                    block.holds.append(hold)
                block.rows += len(batch)
                block.nbytes += batch.nbytes
        self._pending_bytes += block.nbytes
        self.counters.in_flight_rows += block.rows
        self._blocks[block.id] = block
        self._queue(block)
        while not outcome:
            await self._idle.park()
        if outcome[0] is not None:
            raise outcome[0]

    def is_transient(self, error: BaseException) -> bool:
        """True when retrying a failed :meth:`insert_now` may succeed."""
        if isinstance(error, WriterInsertFailed):
            return error.transient
        return isinstance(error, WriterCrashed)

    # -- reading ---------------------------------------------------------------

    async def aquery(self, sql: str) -> pa.Table:
        """Run ``sql`` through the writer process (on the sink's Trio loop)."""
        self._latch.raise_if_failed()
        if self._process is None:
            raise WriterCrashed("the writer process is not running")
        query = PendingQuery(next(self._ids), sql)
        self._queries[query.id] = query
        self._queue(query)
        await query.done.wait()
        return answer_table(query.answer)

    def query(self, sql: str) -> pa.Table:
        """Run ``sql`` on the same ClickHouse (blocking; never on the sink's loop).

        While the sink runs the writer answers; before it runs, too (directly
        on its socket); once the sink is closed a chDB directory is opened in
        this process (the writer has released it).
        """
        if self._stopped.is_set() or self._closing:
            return query_locally(self.config, sql)
        if self._trio_token is None:
            assert self._process is not None
            return answer_table(self._process.request_blocking(Query(0, sql)))
        return trio.from_thread.run(self.aquery, sql, trio_token=self._trio_token)

    # -- observation -------------------------------------------------------------

    @property
    def failure(self) -> BaseException | None:
        """The latched failure, or None."""
        return self._latch.failure

    def insert_errors(self) -> int:
        """Inserts the writer reported failed, retried or not, and writer
        deaths (each cut its inserts short) (``CountsInsertErrors``)."""
        return self.counters.errors + self.counters.crashes

    def given_up_records(self) -> int:
        """Rows this sink took and gave up (``GivesUp``; ``counters.abandoned_rows``):
        buffered or in flight when a failure latched or a shutdown's cut
        killed the writer, never known to be persisted."""
        return self.counters.abandoned_rows

    @property
    def health(self) -> WriterHealth:
        """Whether the writer runs now (unhealthy from a death until it persists again)."""
        return self._health
