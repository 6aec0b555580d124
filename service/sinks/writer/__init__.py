"""Destinations in a writer process: ClickHouse inserts (and chDB's GIL) out of
the model process, payloads shared in memory rather than copied."""

from taproute.service.sinks.writer.errors import (
    DirectoryInUse,
    WriterCrashed,
    WriterDied,
    WriterInsertFailed,
    WriterStartError,
)
from taproute.service.sinks.writer.shared_pool import SegmentRef, SharedBufferPool
from taproute.service.sinks.writer.sink import WriterCounters, WriterHealth, WriterProcessSink

__all__ = [
    "DirectoryInUse",
    "SegmentRef",
    "SharedBufferPool",
    "WriterCounters",
    "WriterCrashed",
    "WriterHealth",
    "WriterInsertFailed",
    "WriterDied",
    "WriterProcessSink",
    "WriterStartError",
]
