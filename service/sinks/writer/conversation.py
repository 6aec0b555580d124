"""The writer sink's conversation with its writer process: sending blocks and
queries, handling what the writer answers (persisted, failed, retried), and
supervising the process (a death is counted, reported, and answered with a
restart that re-sends every unfinished block, or latched).

When an owner keeps its own durable queue (a spool: :meth:`hand_over_failures`),
a block whose insert fails, or that was unfinished when the writer died, is
handed to it under its token instead of being retried or re-sent here (in
the order the blocks were sealed, but a block the writer refused goes
behind the blocks sealed before its refusal came: ``TableOrder.requeue``;
the blocks not sent yet follow it there, untried, until none is left here),
and a dying writer is restarted for as long as it keeps dying (the spool
holds the data meanwhile; only a writer that cannot be started at all
latches)."""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from collections.abc import Callable

import trio

from taproute.routing.hooks import HookRegistry
from taproute.routing.latch import FailureLatch
from taproute.service.sinks.clickhouse.batching import Retry
from taproute.service.sinks.clickhouse.blocks import TableOrder
from taproute.service.sinks.clickhouse.handover import HandsOverToOwner
from taproute.service.sinks.writer.blocks import (
    DONE,
    HANDING,
    HELD,
    QUEUED,
    SENT,
    WAITING,
    Block,
    PendingQuery,
    WriterCounters,
    WriterHealth,
)
from taproute.service.sinks.writer.errors import WriterCrashed, WriterDied, WriterInsertFailed
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
    WriterConfig,
    coalesce_rows,
)
from taproute.service.sinks.writer.shared_pool import SharedBufferPool


class WriterConversation(HandsOverToOwner):
    """The half of :class:`~.sink.WriterProcessSink` that talks to the writer
    process (its state is set up by the sink's constructor)."""

    config: WriterConfig
    hooks: HookRegistry | None
    retry: Retry
    restarts: int
    start_timeout: float
    buffer_pool: SharedBufferPool
    counters: WriterCounters
    _process: WriterProcess | None
    _health: WriterHealth
    _latch: FailureLatch
    _blocks: dict[int, Block]
    _order: TableOrder
    _unsent: deque[Block | PendingQuery]
    _queries: dict[int, PendingQuery]
    _crashes_in_a_row: int
    _wake_sender: trio.lowlevel.ParkingLot
    _space: trio.lowlevel.ParkingLot
    _idle: trio.lowlevel.ParkingLot
    _nursery: trio.Nursery | None
    _closing: bool
    _buffer: Block
    _buffer_started_at: float
    _pending_bytes: int
    #: Buffers of blocks handed to the owner while the writer still had them
    #: (a flush stopped waiting): kept until the writer answers for the
    #: block or dies, since it may still read them from shared memory.
    _abandoned: dict[int, list[object]]
    #: A block of the batched path went to the owner: the blocks not sent
    #: yet follow it there, untried, in order, until none is left here.
    _handing_over: bool

    def _queue(self, item: Block | PendingQuery) -> None:
        if isinstance(item, Block):
            item.state = QUEUED
        self._unsent.append(item)
        self._wake_sender.unpark_all()

    async def _send_in_turn(self, block: Block) -> None:
        """Queue sealed ``block`` for the writer in its turn (see ``_order``);
        nothing if it was settled meanwhile (given up, handed over)."""
        assert block.index is not None
        await self._order.wait_turn(block.index)
        if block.state != HELD:
            return
        if self._handing_over:
            # An earlier block is the owner's to repeat: sent now, this one
            # could land between that block's first try and its repeat.
            self._hand_over_later(
                block,
                WriterInsertFailed(
                    "held back (an earlier block is being repeated by the spool): "
                    f"block {block.token}",
                    transient=False,
                ),
            )
            return
        self._queue(block)

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

    def _died(self, reason: str) -> None:
        """A writer died (``reason``): counted, reported, and what waited on it
        answered (queries) or settled (an owner's blocks, handed over)."""
        self.counters.crashes += 1
        self._crashes_in_a_row += 1
        self._health = WriterHealth(False, time.time(), reason)
        self._release_abandoned()
        for query in list(self._queries.values()):
            self._answer(query, Answer(query.id, None, WriterCrashed(reason)))
        for block in list(self._blocks.values()):  # insert_now's are the spool's to retry
            if block.waiter is not None:
                self._finish(block, WriterCrashed(reason))
            elif self._failed_blocks is not None and block.state not in (HANDING, DONE):
                self._hand_over_later(block, WriterCrashed(reason))

    async def _restart(self, dead: WriterProcess, code: int) -> bool:
        """After writer ``dead`` exited with ``code``: restart it (True) or latch (False)."""
        reason = f"writer process {dead.pid} for {self.config.where} {describe_exit(code)}"
        self._died(reason)
        while True:
            if self._failed_blocks is None and self._crashes_in_a_row > self.restarts:
                error = WriterCrashed(f"{reason}; {self.restarts} restart(s) in a row failed")
                self._give_up(error)
                return False
            await trio.sleep(self.retry.backoff(self._crashes_in_a_row))
            try:
                process = await trio.to_thread.run_sync(
                    WriterProcess.start, self.config, self.start_timeout
                )
            except WriterDied as exc:  # killed while it started: one more death
                reason = str(exc)
                self._died(reason)
                continue
            except Exception as exc:  # it cannot start (its sink refused, no answer)
                self._give_up(exc)
                return False
            break
        if self._closing:  # closed while it started: stop it, whatever cancels us
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(process.kill)
                await process.aclose()
            return False
        self._process = process
        self.counters.restarts += 1
        resend = sorted(
            (b for b in self._blocks.values() if b.state in (QUEUED, SENT)), key=lambda b: b.id
        )
        for block in resend:
            block.state = QUEUED
        # Queries asked while it restarted wait in _unsent: they go to the new one.
        asked = [q for q in self._unsent if isinstance(q, PendingQuery) and q.id in self._queries]
        self._unsent = deque([*resend, *asked])
        self._wake_sender.unpark_all()
        return True

    def _give_up(self, error: BaseException) -> None:
        self._latch.latch(error, destination=self.config.where, where="writer process")
        self._process = None
        self._finish_all(error)
        self._drop_buffer()

    async def _send_loop(self, process: WriterProcess) -> None:
        stream = process.attach()
        try:
            while True:
                while self._unsent:
                    item = self._unsent[0]
                    if isinstance(item, PendingQuery):
                        await stream.send(Query(item.id, item.sql))
                    elif item.state == QUEUED:
                        for raw in item.items:
                            if isinstance(raw, RawItem):
                                await process.hand_segment(self.buffer_pool, raw.segment)
                        # SENT before the send, not after it returns: while this
                        # task waits in send, the writer may insert the block and
                        # its Done be handled, which counts only for a SENT block
                        # (a Done taken as stray left flush() waiting for good).
                        # A send that fails leaves it SENT: a restart re-sends it.
                        item.state = SENT
                        await stream.send(
                            Insert(
                                item.id,
                                item.token,
                                coalesce_rows(item.items),
                                self._hook_table(process),
                            )
                        )
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
        self._release_abandoned(message.block)
        block = self._blocks.get(message.block)
        if block is None or block.state != SENT:
            return
        if isinstance(message, Done):
            self._crashes_in_a_row = 0
            if not self._health.healthy:
                self._health = WriterHealth(True, None, None)
            self.counters.blocks += 1
            self.counters.records += block.rows
            self.counters.bytes += block.nbytes
            if block.waiter is None and self._inserted is not None:
                self._inserted(block.rows, len(block.batches))
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
        elif self._failed_blocks is not None:
            if not message.transient and block.index is not None:
                # Refused (nothing written): behind the blocks tried beside
                # it, whose repeats must not wait for its splits (TableOrder.requeue).
                block.index = self._order.requeue(block.index)
            self._hand_over_later(block, error)
        elif message.transient and block.failures < self.retry.attempts:
            self.counters.retries += 1
            block.state = WAITING
            assert self._nursery is not None
            self._nursery.start_soon(self._retry_later, block)
        else:
            self._latch.latch(
                error,
                destination=self.config.where,
                where=f"insert of {block.rows} rows after {block.failures} attempt(s)",
            )
            self.counters.abandoned_rows += block.rows
            self._finish(block, error)

    def _own_blocks(self) -> bool:
        """True while a block of this sink's batched path is unfinished
        (``insert_now``'s are their callers' to wait for)."""
        return any(block.waiter is None for block in self._blocks.values())

    def _stop_waiting(self, waited: float) -> None:
        """A flush waited ``waited`` seconds for a writer that did not answer
        (hung in an insert, stopped): hand every unfinished block of the
        batched path to the owner under the token it was tried with, as
        after a death."""
        self._take_over_unfinished(
            lambda block: WriterInsertFailed(
                f"no answer within {waited:g} s (flush_timeout): stopped waiting for the "
                f"insert of {block.rows} rows into {self.config.where} by the writer process; "
                "handed to the spool, to be repeated under the same deduplication token",
                transient=True,
            )
        )

    def _take_over_unfinished(self, error: Callable[[Block], BaseException]) -> None:
        """Hand every unfinished block of the batched path to the owner, in
        order, each with ``error(block)``.  A block the writer was sent keeps
        its buffers until the writer answers for it or dies: it may still
        read them (and an owner's ``insert_now`` waits for that answer)."""
        for block in sorted(self._blocks.values(), key=lambda b: b.id):
            # HELD too: a block waiting for its turn behind a block the
            # writer does not answer for would wait with it.
            if block.waiter is not None or block.state not in (HELD, QUEUED, SENT, WAITING):
                continue
            if block.state == SENT:
                self._abandoned[block.id] = block.holds
                block.holds = []
            self._hand_over_later(block, error(block))

    def _release_abandoned(self, block_id: int | None = None) -> None:
        """Give back the buffers of abandoned block ``block_id`` (None: all):
        the writer answered for it, or is gone."""
        ids = list(self._abandoned) if block_id is None else [block_id]
        for abandoned in ids:
            holds = self._abandoned.pop(abandoned, None)
            if holds is None:
                continue
            for hold in holds:
                hold.release()  # type: ignore[attr-defined]
            self._idle.unpark_all()  # an owner's insert_now may wait for it

    def _hand_over_later(self, block: Block, error: BaseException) -> None:
        block.state = HANDING
        self._handing_over = True
        assert self._nursery is not None
        self._nursery.start_soon(self._hand_over, block, error)

    async def _hand_over(self, block: Block, error: BaseException) -> None:
        """Give failed ``block`` to the owner's handler, once every block
        sealed before it is done (the owner spools, and repeats, them in the
        order they were sealed); it is done once handed (a flush waits for
        that: the spool has it durably then)."""
        assert self._failed_blocks is not None
        try:
            if block.index is not None:
                await self._order.wait_turn(block.index, behind_all=True)
            await self._failed_blocks(list(block.batches), block.token, error)
        except Exception as handler_error:
            self._latch.latch(
                handler_error,
                destination=self.config.where,
                where=f"handing over a failed insert of {block.rows} rows",
            )
        finally:
            self._finish(block, None)

    async def _retry_later(self, block: Block) -> None:
        await trio.sleep(self.retry.backoff(block.failures))
        if block.state == WAITING:
            self._queue(block)

    def _finish(self, block: Block, error: BaseException | None) -> None:
        """Block ``block`` is done (persisted, or given up): release its payloads."""
        if block.state == DONE:
            return
        block.state = DONE
        del self._blocks[block.id]
        if block.index is not None:
            self._order.done(block.index)
            if self._handing_over and not self._buffer.items and not self._own_blocks():
                self._handing_over = False
        self.counters.in_flight_rows -= block.rows
        self._pending_bytes -= block.nbytes
        for hold in block.holds:
            hold.release()
        if block.waiter is not None:
            block.waiter.append(error)
        self._space.unpark_all()
        self._idle.unpark_all()

    def _finish_all(self, error: BaseException | None) -> None:
        """The writer is gone for good: every unfinished block is done.  The
        sink's own blocks are given up (counted); ``insert_now``'s get
        ``error`` (their caller, a spool, still holds their batches)."""
        self._release_abandoned()
        for block in list(self._blocks.values()):
            if block.waiter is None:
                self.counters.abandoned_rows += block.rows
            self._finish(block, error if block.waiter is not None else None)
        for query in list(self._queries.values()):
            self._answer(query, Answer(query.id, None, WriterCrashed("the writer process stopped")))

    def _drop_buffer(self) -> None:
        """No block will take what is buffered: give its buffers back and
        count its rows as given up."""
        buffer = self._buffer
        for hold in buffer.holds:
            hold.release()
        self.counters.abandoned_rows += buffer.rows
        self.counters.buffered_rows -= buffer.rows
        self._pending_bytes -= buffer.nbytes
        self._buffer = Block(0, "")
        self._buffer_started_at = math.inf
        self._space.unpark_all()

    def _answer(self, query: PendingQuery, answer: Answer) -> None:
        self._queries.pop(query.id, None)
        query.answer = answer
        query.done.set()

    async def _stop_process(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        try:
            if process.stream is None:
                process.send_close_blocking()
            else:
                with (
                    trio.move_on_after(5),
                    contextlib.suppress(
                        trio.BrokenResourceError, trio.ClosedResourceError, OSError
                    ),
                ):
                    await process.stream.send(Close())
            await trio.to_thread.run_sync(process.stop, 30.0, abandon_on_cancel=True)
        except trio.Cancelled:  # no more waiting for it (a shutdown's grace ran out)
            process.kill()
            process.close_sockets()
            raise
        await process.aclose()
