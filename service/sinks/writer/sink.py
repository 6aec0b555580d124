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

Failure: an insert error the writer reports as transient is retried with the
same token (``Retry``); another, or the retry budget spent, latches the
failure (raised by the next ``submit``/``flush``/``close``), like the
in-process sink.  A writer that dies (crash, SIGKILL) is detected by its
socket ending, counted (``crashes``), reported (``health``), and restarted
with every unfinished block re-sent under its token, so nothing is lost and
nothing is written twice; after ``restarts`` deaths in a row without a
persisted block the failure is latched instead.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
import uuid
from collections import deque
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pyarrow as pa
import trio

from taproute.routing.batch import Batch, RowBatch
from taproute.routing.errors import ConfigError, SinkClosed
from taproute.routing.hooks import HookRegistry
from taproute.routing.latch import FailureLatch
from taproute.routing.schema import RecordSchema
from taproute.service.sinks.clickhouse.batching import Batching, Retry
from taproute.service.sinks.writer.errors import WriterCrashed, WriterInsertFailed
from taproute.service.sinks.writer.process import WriterProcess, describe_exit
from taproute.service.sinks.writer.protocol import (
    Answer,
    Close,
    Done,
    Failed,
    HookTable,
    Insert,
    ProtocolError,
    Query,
    RawItem,
    RowItem,
    WriterConfig,
)
from taproute.service.sinks.writer.shared_pool import SharedBufferPool


@attrs.define
class WriterCounters:
    """Records and blocks persisted through the writer; what failed; how the
    payloads crossed (``shared_bytes`` by reference, ``copied_bytes`` copied
    into shared memory first); writer deaths and restarts."""

    records: int = 0
    bytes: int = 0
    blocks: int = 0
    retries: int = 0
    errors: int = 0
    crashes: int = 0
    restarts: int = 0
    buffered_rows: int = 0
    in_flight_rows: int = 0
    shared_bytes: int = 0
    copied_bytes: int = 0


@attrs.frozen
class WriterHealth:
    """Whether the writer process runs now; since when (epoch seconds) and why not."""

    healthy: bool
    since: float | None
    reason: str | None


class _Release:
    """A hold on a pool buffer the sink copied a payload into."""

    __slots__ = ("_array", "_pool")

    def __init__(self, pool: SharedBufferPool, array: Any) -> None:
        self._pool, self._array = pool, array

    def release(self) -> None:
        array, self._array = self._array, None
        if array is not None:
            self._pool.give_back(array)


_QUEUED, _SENT, _WAITING, _DONE = "queued", "sent", "waiting", "done"


class _Block:
    __slots__ = ("failures", "holds", "id", "items", "nbytes", "rows", "state", "token", "waiter")

    def __init__(self, block_id: int, token: str) -> None:
        self.id = block_id
        self.token = token
        self.items: list[RawItem | RowItem] = []
        self.holds: list[Any] = []
        self.rows = 0
        self.nbytes = 0
        self.failures = 0
        self.state = _QUEUED
        #: insert_now's: where the outcome goes (no retry here), else None.
        self.waiter: list[BaseException | None] | None = None


@attrs.define
class _Query:
    id: int
    sql: str
    done: trio.Event = attrs.field(factory=trio.Event)
    answer: Answer | None = None


class WriterProcessSink:
    """A :class:`~taproute.routing.sink.RecordSink` writing to ClickHouse from a
    writer process (see the module docstring).

    Takes :class:`ClickHouseSink`'s table arguments (``raw``, ``rows``,
    ``create_tables``, ``raw_table``, ``rows_table``,
    ``require_deduplication``), ``batching`` and ``retry``; tables are checked
    (and created) by the writer at construction, and its errors
    (``SchemaMismatch``, ``MissingTable``, ``NoDeduplication``) are raised
    here.  ``restarts``: writer deaths in a row (without a persisted block in
    between) that are answered with a restart; one more latches.

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
        self._buffer = _Block(0, "")
        self._buffer_started_at = math.inf
        self._blocks: dict[int, _Block] = {}
        self._unsent: deque[_Block | _Query] = deque()
        self._queries: dict[int, _Query] = {}
        self._pending_bytes = 0
        self._crashes_in_a_row = 0
        self._wake_sender = trio.lowlevel.ParkingLot()
        self._space = trio.lowlevel.ParkingLot()
        self._idle = trio.lowlevel.ParkingLot()
        self._buffer_started = trio.lowlevel.ParkingLot()
        self._nursery: trio.Nursery | None = None
        self._trio_token: trio.lowlevel.TrioToken | None = None
        self._closing = False
        self._stopped = trio.Event()

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
        return cls(_config("chdb", str(Path(path).resolve()), schema, kwargs), **kwargs)

    @classmethod
    def server(cls, schema: RecordSchema, url: str, **kwargs: Any) -> WriterProcessSink:
        """A writer process inserting into a ClickHouse server at ``url``."""
        kwargs.setdefault("create_tables", False)
        return cls(_config("server", url, schema, kwargs), **kwargs)

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
            self._stopped.set()

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
        if hold is not None:
            buffer.holds.append(hold)
        buffer.rows += len(batch)
        buffer.nbytes += batch.nbytes
        self._pending_bytes += batch.nbytes
        self.counters.buffered_rows += len(batch)
        if buffer.rows >= self.batching.max_rows or buffer.nbytes >= self.batching.max_bytes:
            self._seal()

    def _check_open(self) -> None:
        self._latch.raise_if_failed()
        if self._closing:
            raise SinkClosed("WriterProcessSink is closed")
        if self._nursery is None:
            raise RuntimeError("WriterProcessSink is not running: start its run() task first")

    def _item(self, batch: Batch) -> tuple[RawItem | RowItem, Any]:
        """What crosses to the writer for ``batch`` (checked), and the hold that
        keeps its payload in place until the writer is done."""
        if isinstance(batch, RowBatch):
            if batch.layout_name not in self._row_layouts:
                raise ConfigError(
                    f"WriterProcessSink got rows of layout {batch.layout_name!r} from route "
                    f"{batch.route!r}; it writes rows of {sorted(self._row_layouts)}"
                )
            return RowItem(batch.route, batch.layout_name, batch.rows), None
        layout_ids = batch.descriptors["layout_id"]
        first = int(layout_ids[0])
        found = (
            {first} if bool(np.all(layout_ids == first)) else set(np.unique(layout_ids).tolist())
        )
        if not found <= self._raw_ids:
            bad = sorted(self.schema.by_id(i).name for i in found - self._raw_ids)
            raise ConfigError(
                f"WriterProcessSink got raw records of layout(s) {bad}; it writes raw "
                f"{sorted(self.schema.by_id(i).name for i in self._raw_ids)}"
            )
        payload = batch.payload
        ref = self.buffer_pool.locate(payload)
        if ref is not None:
            self.counters.shared_bytes += payload.nbytes
            hold: Any = batch.retain()
        else:  # not in shared memory: one copy into it
            staging = self.buffer_pool.take_array(payload.nbytes)[: payload.nbytes]
            staging[:] = payload
            ref = self.buffer_pool.locate(staging)
            assert ref is not None
            self.counters.copied_bytes += payload.nbytes
            hold = _Release(self.buffer_pool, staging)
        return RawItem(ref.segment, ref.offset, payload.nbytes, batch.descriptors), hold

    def _seal(self) -> None:
        """Make the buffer a block and queue it for the writer."""
        buffer = self._buffer
        self._buffer_started_at = math.inf
        if not buffer.items:
            return
        block_id = next(self._ids)
        buffer.id, buffer.token = block_id, f"{self._token_prefix}-{block_id}"
        self._buffer = _Block(0, "")
        self.counters.buffered_rows -= buffer.rows
        self.counters.in_flight_rows += buffer.rows
        self._blocks[block_id] = buffer
        self._queue(buffer)

    def _queue(self, item: _Block | _Query) -> None:
        if isinstance(item, _Block):
            item.state = _QUEUED
        self._unsent.append(item)
        self._wake_sender.unpark_all()

    async def flush(self) -> None:
        """Send everything buffered; return once the writer has persisted it all, or raise."""
        self._check_open()
        self._seal()
        while self._blocks:
            await self._idle.park()
        self._latch.raise_if_failed()

    async def close(self) -> None:
        """Flush, stop the writer process, release the pool; idempotent."""
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
            self._finish_all(None)
            for hold in self._buffer.holds:
                hold.release()
            self._buffer = _Block(0, "")
            self.counters.buffered_rows = 0
            self._pending_bytes = 0
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

    async def _stop_process(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        if process.stream is None:
            process.send_close_blocking()
        else:
            with (
                trio.move_on_after(5),
                contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError),
            ):
                await process.stream.send(Close())
        await trio.to_thread.run_sync(process.stop, 30.0)
        await process.aclose()

    # -- insert_now (for a spool wrapping this sink) ---------------------------------

    async def insert_now(self, batches: Sequence[Batch], token: str) -> None:
        """Insert ``batches`` as one block with ``token``; no buffering, no retry.

        Raises the writer's failure (:meth:`is_transient` says whether the same
        call may succeed later); a writer death during the call is transient.
        """
        self._check_open()
        block = _Block(next(self._ids), token)
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

    # -- the writer's conversation ---------------------------------------------------

    async def _supervise(self) -> None:
        """Serve the writer process; when it dies, restart it or latch."""
        while self._process is not None:
            process = self._process
            stream = process.attach()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._send_loop, process)
                try:
                    while (message := await stream.receive()) is not None:
                        self._on_message(message)
                except ProtocolError:
                    pass  # a garbled stream: the writer is not trusted further
                finally:
                    nursery.cancel_scope.cancel()
            if self._closing:
                return
            code = await trio.to_thread.run_sync(process.kill)
            await process.aclose()
            if not await self._restart(process, code):
                return

    async def _restart(self, dead: WriterProcess, code: int) -> bool:
        """After writer ``dead`` exited with ``code``: restart it (True) or latch (False)."""
        self.counters.crashes += 1
        self._crashes_in_a_row += 1
        reason = f"writer process {dead.pid} for {self.config.where} {describe_exit(code)}"
        self._health = WriterHealth(False, time.time(), reason)
        for query in list(self._queries.values()):
            self._answer(query, Answer(query.id, None, WriterCrashed(reason)))
        for block in list(self._blocks.values()):  # insert_now's are the spool's to retry
            if block.waiter is not None:
                self._finish(block, WriterCrashed(reason))
        if self._crashes_in_a_row > self.restarts:
            self._give_up(WriterCrashed(f"{reason}; {self.restarts} restart(s) in a row failed"))
            return False
        await trio.sleep(self.retry.backoff(self._crashes_in_a_row))
        try:
            process = await trio.to_thread.run_sync(
                WriterProcess.start, self.config, self.start_timeout
            )
        except Exception as exc:
            self._give_up(exc)
            return False
        if self._closing:  # closed while it started
            await trio.to_thread.run_sync(process.kill)
            return False
        self._process = process
        self.counters.restarts += 1
        resend = sorted(
            (b for b in self._blocks.values() if b.state in (_QUEUED, _SENT)), key=lambda b: b.id
        )
        for block in resend:
            block.state = _QUEUED
        self._unsent = deque(resend)
        self._wake_sender.unpark_all()
        return True

    def _give_up(self, error: BaseException) -> None:
        self._latch.latch(error, destination=self.config.where, where="writer process")
        self._process = None
        self._finish_all(error)

    async def _send_loop(self, process: WriterProcess) -> None:
        stream = process.attach()
        try:
            while True:
                while self._unsent:
                    item = self._unsent[0]
                    if isinstance(item, _Query):
                        await stream.send(Query(item.id, item.sql))
                    elif item.state == _QUEUED:
                        for raw in item.items:
                            if isinstance(raw, RawItem):
                                await process.hand_segment(self.buffer_pool, raw.segment)
                        await stream.send(
                            Insert(item.id, item.token, item.items, self._hook_table(process))
                        )
                        item.state = _SENT
                    self._unsent.popleft()
                await self._wake_sender.park()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            return  # the writer is gone: the supervisor sees its stream end

    def _hook_table(self, process: WriterProcess) -> HookTable | None:
        """The hook table, when it changed since ``process`` last got it."""
        if self.hooks is None:
            return None
        names = self.hooks.names()
        table = HookTable(names, {i: self.hooks.token_shape_of(i) for i in range(len(names))})
        if table == process.hooks_sent:
            return None
        process.hooks_sent = table
        return table

    def _on_message(self, message: object) -> None:
        if isinstance(message, Answer):
            query = self._queries.get(message.query)
            if query is not None:
                self._answer(query, message)
            return
        if not isinstance(message, (Done, Failed)):
            return
        block = self._blocks.get(message.block)
        if block is None or block.state != _SENT:
            return
        if isinstance(message, Done):
            self._crashes_in_a_row = 0
            if not self._health.healthy:
                self._health = WriterHealth(True, None, None)
            self.counters.blocks += 1
            self.counters.records += block.rows
            self.counters.bytes += block.nbytes
            self._finish(block, None)
            return
        self.counters.errors += 1
        block.failures += 1
        error = WriterInsertFailed(
            f"insert of {block.rows} rows into {self.config.where} failed in the writer "
            f"process: {type(message.error).__name__}: {message.error}",
            transient=message.transient,
        )
        error.__cause__ = message.error
        if block.waiter is not None:
            self._finish(block, error)
        elif message.transient and block.failures < self.retry.attempts:
            self.counters.retries += 1
            block.state = _WAITING
            assert self._nursery is not None
            self._nursery.start_soon(self._retry_later, block)
        else:
            self._latch.latch(
                error,
                destination=self.config.where,
                where=f"insert of {block.rows} rows after {block.failures} attempt(s)",
            )
            self._finish(block, error)

    async def _retry_later(self, block: _Block) -> None:
        await trio.sleep(self.retry.backoff(block.failures))
        if block.state == _WAITING:
            self._queue(block)

    def _finish(self, block: _Block, error: BaseException | None) -> None:
        """Block ``block`` is done (persisted, or given up): release its payloads."""
        if block.state == _DONE:
            return
        block.state = _DONE
        del self._blocks[block.id]
        self.counters.in_flight_rows -= block.rows
        self._pending_bytes -= block.nbytes
        for hold in block.holds:
            hold.release()
        if block.waiter is not None:
            block.waiter.append(error)
        self._space.unpark_all()
        self._idle.unpark_all()

    def _finish_all(self, error: BaseException | None) -> None:
        for block in list(self._blocks.values()):
            self._finish(block, error if block.waiter is not None else None)
        for query in list(self._queries.values()):
            self._answer(query, Answer(query.id, None, WriterCrashed("the writer process stopped")))

    def _answer(self, query: _Query, answer: Answer) -> None:
        self._queries.pop(query.id, None)
        query.answer = answer
        query.done.set()

    # -- reading ---------------------------------------------------------------

    async def aquery(self, sql: str) -> pa.Table:
        """Run ``sql`` through the writer process (on the sink's Trio loop)."""
        self._latch.raise_if_failed()
        if self._process is None:
            raise WriterCrashed("the writer process is not running")
        query = _Query(next(self._ids), sql)
        self._queries[query.id] = query
        self._queue(query)
        await query.done.wait()
        return _table(query.answer)

    def query(self, sql: str) -> pa.Table:
        """Run ``sql`` on the same ClickHouse (blocking; never on the sink's loop).

        While the sink runs the writer answers; before it runs, too (directly
        on its socket); once the sink is closed a chDB directory is opened in
        this process (the writer has released it).
        """
        if self._stopped.is_set() or self._closing:
            return _query_locally(self.config, sql)
        if self._trio_token is None:
            assert self._process is not None
            return _table(self._process.request_blocking(Query(0, sql)))
        return trio.from_thread.run(self.aquery, sql, trio_token=self._trio_token)

    # -- observation -------------------------------------------------------------

    @property
    def failure(self) -> BaseException | None:
        """The latched failure, or None."""
        return self._latch.failure

    @property
    def health(self) -> WriterHealth:
        """Whether the writer runs now (unhealthy from a death until it persists again)."""
        return self._health


def _table(answer: object) -> pa.Table:
    if not isinstance(answer, Answer):
        raise WriterCrashed(f"the writer process answered {answer!r} to a query")
    if answer.error is not None:
        raise answer.error
    if not answer.arrow:
        return pa.table({})
    return pa.ipc.open_file(pa.BufferReader(answer.arrow)).read_all()


def _query_locally(config: WriterConfig, sql: str) -> pa.Table:
    """``sql`` once the writer is gone: chDB opened in this process, or, when
    this process already has another chDB directory open (one per process),
    through a writer process started for the query."""
    from taproute.service.sinks.clickhouse.transport import ChdbTransport, ServerTransport

    try:
        transport = (
            ChdbTransport(config.where) if config.kind == "chdb" else ServerTransport(config.where)
        )
    except ConfigError:
        process = WriterProcess.start(attrs.evolve(config, create_tables=False), 120.0)
        try:
            return _table(process.request_blocking(Query(0, sql)))
        finally:
            process.send_close_blocking()
            process.stop(30.0)
            process.close_sockets()
    try:
        return transport.query(sql)
    finally:
        transport.close()


def _config(kind: str, where: str, schema: RecordSchema, kwargs: dict[str, Any]) -> WriterConfig:
    """A :class:`WriterConfig` from the table keywords in ``kwargs`` (removed from it)."""
    batching = kwargs.get("batching") or Batching()
    table_options = {
        name: kwargs.pop(name)
        for name in ("create_tables", "raw_table", "rows_table", "require_deduplication")
        if name in kwargs
    }
    return WriterConfig(
        kind=kind,
        where=where,
        schema=schema,
        raw=tuple(_names(kwargs.pop("raw", ()))),
        rows=tuple(_names(kwargs.pop("rows", ()))),
        inserts_in_flight=batching.inserts_in_flight,
        **table_options,
    )


def _names(value: Iterable[str]) -> list[str]:
    return [value] if isinstance(value, str) else list(value)
