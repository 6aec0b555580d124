"""A spooling destination's dead letters: records it refused, or its quota
shed, handed to a dead-letter store as :class:`~taproute.routing.failures.RecordFailure`.

The letter's route is ``destination:<name>`` (no route refused them: the
destination did) and its code ``destination_refused`` or ``spool_full``.
The store keeps raw records; processed rows have no place there
(:class:`~.spool.CannotDeadLetter`: the spooling sink drops and counts them).
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Awaitable, Callable

from taproute.routing.batch import Batch, RecordBatch
from taproute.routing.failures import FailureCode, RecordFailure
from taproute.service.sinks.spool.files import NO_ROOM
from taproute.service.sinks.spool.spool import CannotDeadLetter, DeadLetter

#: Where the letters go (a ``DeadLetterStore.handle``).
LetterHandler = Callable[[RecordFailure], Awaitable[None]]

#: The reason the spool's ``dead_letter`` quota policy gives.
SPOOL_FULL = "spool_full"


class GivenUp(Exception):
    """Why a destination gave records up (the letter's error)."""


def store_full(exc: BaseException) -> bool:
    """True when ``exc`` says the dead-letter store has no room: SQLite's
    ``SQLITE_FULL`` (a full disk, or the database's ``max_page_count``) or the
    file system's own no-room errors."""
    if isinstance(exc, sqlite3.Error):
        return getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL
    return isinstance(exc, OSError) and exc.errno in NO_ROOM


def destination_dead_letters(handle: LetterHandler, name: str) -> DeadLetter:
    """A :data:`~.spool.DeadLetter` callback for destination ``name`` writing to ``handle``."""

    async def dead_letter(batch: Batch, reason: str) -> None:
        if not isinstance(batch, RecordBatch):
            raise CannotDeadLetter(
                f"{len(batch)} processed row(s) of route {batch.route!r}, layout "
                f"{batch.layout_name!r} ({reason}): the dead-letter store keeps raw records only"
            )
        code = FailureCode.SPOOL_FULL if reason == SPOOL_FULL else FailureCode.DESTINATION_REFUSED
        now = time.time()
        try:
            await handle(
                RecordFailure(
                    route=f"destination:{name}",
                    processor=None,
                    error=GivenUp(reason),
                    records=batch,
                    code=code,
                    first_failure_at=now,
                    last_failure_at=now,
                )
            )
        except Exception as exc:
            if not store_full(exc):
                raise
            # Often the same full disk as the spool's: drop and count, never
            # fail the destination (and with it the router) for it.
            raise CannotDeadLetter(
                f"{len(batch)} record(s) ({reason}): the dead-letter store is full: {exc}"
            ) from exc

    return dead_letter


__all__ = ["SPOOL_FULL", "GivenUp", "LetterHandler", "destination_dead_letters", "store_full"]
