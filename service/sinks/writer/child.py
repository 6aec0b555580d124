"""The writer process: a ClickHouse sink in its own interpreter, fed from the
model process's shared buffers.

Started as ``python -m taproute.service.sinks.writer.child MSG_FD SEG_FD``
by :class:`~taproute.service.sinks.writer.process.WriterProcess`.  It reads
a :class:`~.protocol.WriterConfig`, builds the
:class:`~taproute.service.sinks.clickhouse.ClickHouseSink` (tables checked
and created here, so chDB's directory and its GIL are this process's),
answers ``Ready`` or ``StartFailed``, then serves ``Insert`` (through the
sink's ``insert_now``: one block per table, deduplication tokens from the
model process, so a block re-sent after a crash is written once) and
``Query`` until ``Close`` or the end of its message socket (the model
process is gone), and exits.  Payloads are read in place from the shared
segments: never copied into this process before Arrow reads them.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import trio

from taproute.native import DESCRIPTOR_DTYPE, BufferLease
from taproute.routing.batch import Batch, RecordBatch, RowBatch
from taproute.routing.hooks import HookRegistry
from taproute.service.sinks.clickhouse.batching import Batching
from taproute.service.sinks.clickhouse.sink import ClickHouseSink
from taproute.service.sinks.writer.errors import DirectoryInUse
from taproute.service.sinks.writer.protocol import (
    Answer,
    Close,
    Done,
    Failed,
    HookTable,
    Insert,
    MessageStream,
    Query,
    Ready,
    RowItem,
    StartFailed,
    WriterConfig,
    portable_error,
    receive_blocking,
    receive_segment,
    send_blocking,
)
from taproute.service.sinks.writer.shared_pool import SegmentViews

logger = logging.getLogger(__name__)


def check_directory_free(path: Path) -> None:
    """Raise :class:`DirectoryInUse` when another process holds ``path``.

    chDB (the ClickHouse engine) locks ``<path>/status`` for as long as a
    process has the directory open, and refuses a second process with a bare
    "Error initializing EmbeddedServer"; this names the cause instead.
    """
    status = path / "status"
    if not status.exists():
        return
    with open(status, "rb") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DirectoryInUse(
                f"chDB directory {path} is open in another process (this one's in-process "
                "chDB sink, a running service, the taproute CLI); chDB allows one process "
                "per directory: close it there first"
            ) from None
        fcntl.flock(held, fcntl.LOCK_UN)


def build_sink(config: WriterConfig) -> ClickHouseSink:
    """The ClickHouse sink ``config`` describes (tables checked, created if asked)."""
    options: dict[str, Any] = {
        "raw": config.raw,
        "rows": config.rows,
        "create_tables": config.create_tables,
        "raw_table": config.raw_table,
        "rows_table": config.rows_table,
        "require_deduplication": config.require_deduplication,
        # The inserts that may run at once: what a table's deduplication window
        # must hold for one of them to be repeated exactly.
        "batching": Batching(inserts_in_flight=config.inserts_in_flight),
    }
    if config.kind == "chdb":
        check_directory_free(Path(config.where))
        return ClickHouseSink.embedded(config.schema, config.where, **options)
    return ClickHouseSink.server(config.schema, config.where, **options)


class _Writer:
    def __init__(self, sink: ClickHouseSink, config: WriterConfig, stream: MessageStream) -> None:
        self.sink = sink
        self.stream = stream
        self.views = SegmentViews()
        self.arrived: dict[int, trio.Event] = {}
        self.hooks = HookRegistry()
        sink.use_hooks(self.hooks)
        self.limiter = trio.CapacityLimiter(config.inserts_in_flight)

    def _arrival(self, segment: int) -> trio.Event:
        event = self.arrived.get(segment)
        if event is None:
            event = self.arrived[segment] = trio.Event()
        return event

    async def receive_segments(self, sock: trio.socket.SocketType) -> None:
        while True:
            received = await receive_segment(sock)
            if received is None:
                return
            segment, fd, size = received
            self.views.add(segment, fd, size)
            self._arrival(segment).set()

    def update_hooks(self, table: HookTable) -> None:
        for name in table.names[len(self.hooks) :]:
            self.hooks.bind(name)
        for output_id, shape in table.shapes.items():
            self.hooks.set_token_shape(output_id, shape)

    async def insert(self, message: Insert) -> None:
        async with self.limiter:
            try:
                batches: list[Batch] = []
                for item in message.items:
                    if isinstance(item, RowItem):
                        batches.append(RowBatch(item.route, item.layout_name, item.rows))
                        continue
                    await self._arrival(item.segment).wait()
                    payload = self.views.view(item.segment, item.offset, item.length)
                    descriptors = item.descriptors
                    if descriptors.dtype != DESCRIPTOR_DTYPE:
                        raise TypeError(f"descriptors of dtype {descriptors.dtype}")
                    batches.append(RecordBatch(descriptors, payload, BufferLease(None)))
                await self.sink.insert_now(batches, message.token)
            except Exception as exc:
                reply: object = Failed(
                    message.block, portable_error(exc), self.sink.is_transient(exc)
                )
            else:
                reply = Done(message.block)
            await self.stream.send(reply)

    async def query(self, message: Query) -> None:
        try:
            table = await trio.to_thread.run_sync(self.sink.query, message.sql)
            sink = pa.BufferOutputStream()
            with pa.ipc.new_file(sink, table.schema) as writer:
                writer.write_table(table)
            reply = Answer(message.query, sink.getvalue().to_pybytes(), None)
        except Exception as exc:
            reply = Answer(message.query, None, portable_error(exc))
        await self.stream.send(reply)

    async def serve(self, segments: socket.socket) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.receive_segments, trio.socket.from_stdlib_socket(segments))
            while True:
                message = await self.stream.receive()
                if message is None or isinstance(message, Close):
                    break
                if isinstance(message, Insert):
                    if message.hooks is not None:
                        self.update_hooks(message.hooks)  # in order, before its batches
                    nursery.start_soon(self.insert, message)
                elif isinstance(message, Query):
                    nursery.start_soon(self.query, message)
            # Close comes after a flush (nothing in flight); an ended stream
            # means the model process is gone: nobody is left to answer.
            nursery.cancel_scope.cancel()


async def _serve(
    sink: ClickHouseSink, config: WriterConfig, messages: socket.socket, segments: socket.socket
) -> None:
    await _Writer(sink, config, MessageStream(messages)).serve(segments)


def lower_priority(nice: int) -> None:
    """Add ``nice`` to the niceness of every thread of this process.

    Linux keeps a niceness per thread, and a new thread takes its creator's:
    set here, before the sink is built, it holds for chDB's threads too.
    """
    if nice <= 0:
        return
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:  # not Linux: the process's niceness
        os.nice(nice)
        return
    for tid in threads:
        with contextlib.suppress(ProcessLookupError):  # a thread that has ended
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)


def main(argv: list[str]) -> int:
    messages = socket.socket(fileno=int(argv[1]))
    segments = socket.socket(fileno=int(argv[2]))
    config = receive_blocking(messages)
    if not isinstance(config, WriterConfig):
        return 2
    try:
        lower_priority(config.nice)  # before chDB starts its threads: they inherit it
        sink = build_sink(config)
    except BaseException as exc:
        send_blocking(messages, StartFailed(portable_error(exc)))
        return 1
    try:
        send_blocking(messages, Ready(os.getpid()))
    except BaseException:
        sink.release_transport()
        raise
    serve_then_release(sink, config, messages, segments)
    return 0


def serve_then_release(
    sink: ClickHouseSink, config: WriterConfig, messages: socket.socket, segments: socket.socket
) -> None:
    """Serve until ``Close`` or the end of the message socket, then close the
    sink's transport, never under an insert still running.

    An ended socket (the model process is gone) cancels the inserts in
    progress, and a cancelled ``insert_now`` abandons its worker thread: the
    insert runs on, within the transport's timeouts.  Closing the transport
    then (chDB's insert connections, a client's pool) would pull it from
    under that thread, and exiting would stop it half-way; so the transport
    is closed when the last such insert returned, and this waits for that
    (the model process's ``stop`` kills a writer that takes too long).
    """
    try:
        trio.run(_serve, sink, config, messages, segments)
    finally:
        running = sink.calls_running
        if running:
            logger.warning(
                "writer for %s: %d insert(s) abandoned at shutdown still running; "
                "closing the transport once they return",
                config.where,
                running,
            )
        sink.release_transport()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
