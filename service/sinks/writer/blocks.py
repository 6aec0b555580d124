"""What :class:`~.sink.WriterProcessSink` keeps track of: blocks on their way
to the writer process, queries awaiting the writer's answer, and the
counters and health it reports."""

from __future__ import annotations

from typing import Any

import attrs
import trio

from taproute.routing.batch import Batch
from taproute.service.sinks.writer.protocol import Answer, RawItem, RowItem


@attrs.define
class WriterCounters:
    """Records and blocks persisted through the writer; what failed; how the
    payloads crossed (``shared_bytes``: the bytes the records sent by
    reference cover; ``copied_bytes``: bytes copied into shared memory
    first); writer deaths and restarts.  ``abandoned_rows``: rows this sink
    took and gave up, never known to be persisted: buffered or in flight when
    a failure latched (a writer dying past ``restarts``, an insert refused or
    out of retries) or when its writer was killed at a shutdown's cut.  Only
    grows; taken rows = ``records`` persisted + ``abandoned_rows`` + what is
    still buffered or in flight."""

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
    abandoned_rows: int = 0


@attrs.frozen
class WriterHealth:
    """Whether the writer process runs now; since when (epoch seconds) and why not."""

    healthy: bool
    since: float | None
    reason: str | None


#: A block is HELD from its seal until its turn in the sink's start order
#: (:class:`~taproute.service.sinks.clickhouse.blocks.TableOrder`), then
#: QUEUED for the sender, SENT, WAITING for a retry, HANDING to an owner, DONE.
HELD, QUEUED, SENT, WAITING, HANDING, DONE = (
    "held",
    "queued",
    "sent",
    "waiting",
    "handing",
    "done",
)


class Block:
    """A block of batches sent to the writer as one insert under one token."""

    __slots__ = (
        "batches",
        "failures",
        "holds",
        "id",
        "index",
        "items",
        "nbytes",
        "rows",
        "state",
        "token",
        "waiter",
    )

    def __init__(self, block_id: int, token: str) -> None:
        self.id = block_id
        self.token = token
        self.items: list[RawItem | RowItem] = []
        #: The batches themselves, kept only while an owner (a spool) takes
        #: failed blocks over: what it is handed.
        self.batches: list[Batch] = []
        self.holds: list[Any] = []
        self.rows = 0
        self.nbytes = 0
        self.failures = 0
        self.state = QUEUED
        #: The sink's own blocks: their place in its start order, counted from
        #: 0 as sealed (None: insert_now's, which the owner orders).
        self.index: int | None = None
        #: insert_now's: where the outcome goes (no retry here), else None.
        self.waiter: list[BaseException | None] | None = None


@attrs.define
class PendingQuery:
    id: int
    sql: str
    done: trio.Event = attrs.field(factory=trio.Event)
    answer: Answer | None = None
