"""Destination sinks with behaviour tests need: gated, failing, counting."""

from __future__ import annotations

import threading
from typing import Any

import trio

from taproute.routing import Batch, RecordBatch
from taproute.service import CaptureSink


class NullSink:
    """Counts what it gets and keeps nothing (so buffers go back at once)."""

    def __init__(self) -> None:
        self.records = 0
        self.batches = 0
        self.closed = False
        self.flushes = 0
        self.seen_payloads: list[object] = []

    async def submit(self, batch: Batch) -> None:
        self.records += len(batch)
        self.batches += 1
        if isinstance(batch, RecordBatch):
            self.seen_payloads.append(batch.payload)

    async def flush(self) -> None:
        self.flushes += 1

    async def close(self) -> None:
        self.closed = True


class HeldFlush(NullSink):
    """A destination whose flush waits for ``release`` (a hung server), in a
    worker thread that does not let itself be abandoned: the loop cannot end
    before it returns (``HeldInThread`` is the abandonable kind)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    async def flush(self) -> None:
        await trio.to_thread.run_sync(self.release.wait)
        await super().flush()


class StallsLoop(NullSink):
    """A destination whose submit blocks the runtime's loop until ``release``
    is set: the record worker stops, so ingress fills whatever the mailboxes
    would take."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        #: Set once a submit stalls the loop.
        self.stalled = threading.Event()

    async def submit(self, batch: Batch) -> None:
        self.stalled.set()
        self.release.wait()
        await super().submit(batch)


class GateSink(CaptureSink):
    """Holds every submit until ``gate`` is set (a deliberately slow destination)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = trio.Event()
        self.entered = 0

    async def submit(self, batch: Batch) -> None:
        self.entered += 1
        await self.gate.wait()
        await super().submit(batch)


class FailingSink(CaptureSink):
    """Raises on its ``fail_on``-th submit (1-based) and every one after."""

    def __init__(self, fail_on: int, message: str = "disk full") -> None:
        super().__init__()
        self.fail_on = fail_on
        self.message = message
        self.calls = 0

    async def submit(self, batch: Batch) -> None:
        self.calls += 1
        if self.calls >= self.fail_on:
            raise OSError(self.message)
        await super().submit(batch)


class GatedFailingSink(GateSink):
    """Waits for ``gate``, then raises on every submit."""

    def __init__(self, message: str) -> None:
        super().__init__()
        self.message = message

    async def submit(self, batch: Batch) -> None:
        self.entered += 1
        await self.gate.wait()
        raise OSError(self.message)


class HeldSubmit(NullSink):
    """A destination whose every submit waits for an event never set unless
    ``release`` is: a hung destination the loop can cancel.  ``entered`` is
    set (a thread event) once a submit is waiting."""

    def __init__(self) -> None:
        super().__init__()
        self.release = trio.Event()
        self.entered = threading.Event()

    async def submit(self, batch: Batch) -> None:
        self.entered.set()
        await self.release.wait()
        await super().submit(batch)


class HeldInThread(NullSink):
    """A destination whose submit waits in a worker thread for ``release``
    (a blocking client call that never returns), abandoned when cancelled.
    ``entered`` is set once a submit's thread waits; ``left`` once one returned."""

    def __init__(self, *, in_flush: bool = False) -> None:
        super().__init__()
        self.in_flush = in_flush
        self.release = threading.Event()
        self.entered = threading.Event()
        self.left = threading.Event()

    def _wait(self) -> None:
        self.entered.set()
        self.release.wait()
        self.left.set()

    async def submit(self, batch: Batch) -> None:
        if not self.in_flush:
            await trio.to_thread.run_sync(self._wait, abandon_on_cancel=True)
        await super().submit(batch)

    async def flush(self) -> None:
        if self.in_flush:
            await trio.to_thread.run_sync(self._wait, abandon_on_cancel=True)
        await super().flush()


async def close_cancelled_while_inserting(
    sink: Any, entered: threading.Event, timeout: float = 10.0
) -> bool:
    """Hand ``sink`` (running) one batch of 8 records, then close it and
    cancel that close once the sink's insert of them waits (``entered``, set
    by a held insert). True when the close was cancelled (not finished)."""
    from tests.conftest import vec_batch

    batch = vec_batch(0, 8)
    await sink.submit(batch)
    batch.lease.release()
    async with trio.open_nursery() as nursery:
        with trio.CancelScope() as caller:

            async def cancel_once_the_insert_waits() -> None:
                await trio.to_thread.run_sync(entered.wait, timeout)
                caller.cancel()

            nursery.start_soon(cancel_once_the_insert_waits)
            await sink.close()
    return caller.cancelled_caught
