"""The writer process's shutdown never closes the transport under an insert.

When the model process goes away (the writer's message socket ends), the
writer cancels what it serves, and a cancelled ``insert_now`` abandons its
worker thread: the insert runs on.  The writer used to close the transport
right after ``trio.run`` returned, pulling chDB's insert connection from
under that thread (and then exit, stopping it half-way).  Now it closes the
transport when the last abandoned insert returned, and waits for that.

Run here on the writer's own serve-and-shutdown function, in a thread, with
a real chDB transport whose insert is held until the test lets it go.
"""

from __future__ import annotations

import logging
import socket
import threading
import uuid

import numpy as np

from taproute.routing import Layout, RecordSchema
from taproute.service.sinks.clickhouse import ChdbTransport, ClickHouseSink
from taproute.service.sinks.writer.child import serve_then_release
from taproute.service.sinks.writer.protocol import Insert, RowItem, WriterConfig, send_blocking
from tests.test_runtime import eventually

ROWS = Layout("held_rows", [("key", "Int64"), ("value", "Float64")])
SCHEMA = RecordSchema([ROWS])


class HeldInsert(ChdbTransport):
    """chDB, with each insert held until ``release`` is set; records whether
    the transport was closed while an insert ran."""

    def __init__(self, path) -> None:
        super().__init__(path)
        self.entered = threading.Event()
        self.release = threading.Event()
        self.inserting = 0
        self.inserted = 0
        self.closed_while_inserting: int | None = None

    def insert(self, table, data, *, dedup_token, settings=None) -> None:
        self.inserting += 1
        self.entered.set()
        try:
            assert self.release.wait(60), "the test never released the insert"
            super().insert(table, data, dedup_token=dedup_token, settings=settings)
            self.inserted += 1
        finally:
            self.inserting -= 1

    def close(self) -> None:
        if self.closed_while_inserting is None:
            self.closed_while_inserting = self.inserting
        self.release.set()  # a held insert goes on (before the fix: on a closed transport)
        super().close()


def test_an_insert_abandoned_at_shutdown_returns_before_the_transport_closes(
    chdb_transport, caplog
):
    table = "held_" + uuid.uuid4().hex[:8]
    transport = HeldInsert(chdb_transport.path)
    sink = ClickHouseSink(
        transport, SCHEMA, rows=["held_rows"], rows_table=table, create_tables=True
    )
    config = WriterConfig(kind="chdb", where=str(chdb_transport.path), schema=SCHEMA)
    model_messages, writer_messages = socket.socketpair()
    model_segments, writer_segments = socket.socketpair()
    writer = threading.Thread(
        target=serve_then_release, args=(sink, config, writer_messages, writer_segments)
    )
    caplog.set_level(logging.WARNING, logger="taproute.service.sinks.writer.child")
    writer.start()
    try:
        rows = np.zeros(3, dtype=ROWS.dtype)
        rows["key"] = [1, 2, 3]
        send_blocking(model_messages, Insert(1, "tok-1", [RowItem("r", "held_rows", rows)], None))
        assert transport.entered.wait(60)
        model_messages.close()  # the model process is gone: the writer shuts down
        model_segments.close()
        # Until the held insert is released, the writer either closed the
        # transport (under it) or says it waits for it.
        eventually(
            lambda: (
                transport.closed_while_inserting is not None
                or "abandoned at shutdown still running" in caplog.text
            )
        )
        assert transport.closed_while_inserting is None, "transport closed under an insert"
        assert writer.is_alive()  # waiting for the insert, not exited half-way
        transport.release.set()
        writer.join(60)
        assert not writer.is_alive()
        assert transport.closed_while_inserting == 0  # closed after the insert returned
        assert transport.inserted == 1
        written = chdb_transport.query(f"SELECT key FROM `{table}` ORDER BY key")
        assert written.to_pylist() == [{"key": 1}, {"key": 2}, {"key": 3}]
    finally:
        transport.release.set()
        writer.join(60)
        for sock in (model_messages, model_segments, writer_messages, writer_segments):
            sock.close()
