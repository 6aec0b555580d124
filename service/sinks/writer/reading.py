"""Reading a writer sink's tables: turning the writer's answer into an Arrow
table, and querying the tables once the writer is gone."""

from __future__ import annotations

import attrs
import pyarrow as pa

from taproute.routing.errors import ConfigError
from taproute.service.sinks.writer.errors import WriterCrashed
from taproute.service.sinks.writer.process import WriterProcess
from taproute.service.sinks.writer.protocol import Answer, Query, WriterConfig


def answer_table(answer: object) -> pa.Table:
    if not isinstance(answer, Answer):
        raise WriterCrashed(f"the writer process answered {answer!r} to a query")
    if answer.error is not None:
        raise answer.error
    if not answer.arrow:
        return pa.table({})
    return pa.ipc.open_file(pa.BufferReader(answer.arrow)).read_all()


def query_locally(config: WriterConfig, sql: str) -> pa.Table:
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
            return answer_table(process.request_blocking(Query(0, sql)))
        finally:
            process.send_close_blocking()
            process.stop(30.0)
            process.close_sockets()
    try:
        return transport.query(sql)
    finally:
        transport.close()
