"""What a ClickHouse sink hands its owner when it does not retry a failed
insert itself (a spooling destination takes failed blocks over)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from taproute.routing.batch import Batch

#: Takes over a sealed block whose insert failed, instead of this sink's own
#: retries and latch: called with (batches, token, error) where ``token`` is
#: the one the block was tried with (``insert_now(batches, token)`` repeats
#: that try exactly).  A handler that raises latches the sink.
FailedBlockHandler = Callable[[list[Batch], str, BaseException], Awaitable[None]]


class PartlyInserted(Exception):
    """An ``insert_now`` of several tables stored some and failed on the next.

    ``rest`` are the batches (parts, by table) not stored; ``cause`` is the error.
    """

    def __init__(self, rest: list[Batch], cause: BaseException) -> None:
        super().__init__(f"{len(rest)} part(s) not inserted: {type(cause).__name__}: {cause}")
        self.rest = rest
        self.cause = cause


__all__ = ["FailedBlockHandler", "PartlyInserted"]
