"""What a ClickHouse sink hands its owner when it does not retry a failed
insert itself (a spooling destination takes failed blocks over)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from taproute.routing.batch import Batch
from taproute.service.sinks.clickhouse.batching import Batching

#: Takes over a sealed block whose insert failed, instead of this sink's own
#: retries and latch: called with (batches, token, error) where ``token`` is
#: the one the block was tried with (``insert_now(batches, token)`` repeats
#: that try exactly).  A handler that raises latches the sink.
FailedBlockHandler = Callable[[list[Batch], str, BaseException], Awaitable[None]]


class HandsOverToOwner:
    """The members a batched sink (the in-process ClickHouse sink, the writer
    process sink) shows an owner that keeps its own durable queue: failed
    blocks handed over instead of retried, and the backlog the owner watches
    to decide when to spill.  The sink sets the state declared here."""

    batching: Batching
    _failed_blocks: FailedBlockHandler | None
    _inserted: Callable[[int, int], None] | None
    _pending_bytes: int

    def hand_over_failures(
        self, handler: FailedBlockHandler, inserted: Callable[[int, int], None] | None = None
    ) -> None:
        """Give every sealed block this sink does not persist to ``handler`` (a
        spool) under the token it was tried with, instead of retrying it here
        and latching: a block whose insert failed, and (writer process) one
        unfinished when the writer died.  Tell ``inserted(records, batches)``
        about every block persisted."""
        self._failed_blocks = handler
        self._inserted = inserted

    @property
    def backlog_bytes(self) -> int:
        """Payload bytes accepted by ``submit`` and not yet persisted or handed
        over: buffered, or in an insert (sent to the writer process)."""
        return self._pending_bytes

    @property
    def max_backlog_bytes(self) -> int:
        """The backlog at which ``submit`` waits (``batching.max_buffered_bytes``)."""
        return self.batching.max_buffered_bytes


class PartlyInserted(Exception):
    """An ``insert_now`` of several tables stored some and failed on the next.

    ``rest`` are the batches (parts, by table) not stored; ``cause`` is the error.
    """

    def __init__(self, rest: list[Batch], cause: BaseException) -> None:
        super().__init__(f"{len(rest)} part(s) not inserted: {type(cause).__name__}: {cause}")
        self.rest = rest
        self.cause = cause


__all__ = ["FailedBlockHandler", "HandsOverToOwner", "PartlyInserted"]
