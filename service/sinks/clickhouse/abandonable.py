"""Blocking calls on a transport that an owner may stop waiting for.

A spooling destination's drain inserts spooled groups and checks tables in
worker threads.  While the server is unreachable such a call blocks for the
transport's own timeouts (clickhouse-connect's ``connect_timeout``, 10 s, per
connection try; ``send_receive_timeout``, 300 s, when a server accepts and
never answers), and a Trio worker thread cannot be interrupted: waiting for
it made ``close()`` of an unreachable destination take tens of seconds.

:class:`AbandonableCalls` lets the waiting task be cancelled at once
(``trio.to_thread.run_sync(..., abandon_on_cancel=True)``): the call runs on
in its thread, within those timeouts, and its outcome is dropped.  That is
safe for what the drain does: its batches were read from the spool (memory
the thread holds a reference to) and stay unacknowledged there, so the next
start repeats the try under the same deduplication token.  What is not safe
is closing the transport under a running call (chDB's session, a client's
pool), so :meth:`AbandonableCalls.close` closes it at once only when no
call runs, and otherwise leaves it to the last call to return; a call that
starts after ``close`` raises :class:`~taproute.routing.errors.SinkClosed`
without touching the transport.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import trio

from taproute.routing.errors import SinkClosed

T = TypeVar("T")


class AbandonableCalls:
    """Calls on one transport, each in a worker thread its caller may abandon;
    ``close_transport`` (None: the transport is not ours to close) runs once,
    when the transport is closed and no call runs."""

    def __init__(self, description: str, close_transport: Callable[[], None] | None) -> None:
        self._description = description
        self._close_transport = close_transport
        self._lock = threading.Lock()
        self._running = 0
        self._closed = False
        self._released = threading.Event()  # closed, and no call runs any more

    @property
    def running(self) -> int:
        """Calls running now (abandoned ones included)."""
        return self._running

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` in a worker thread; cancelling the caller abandons it
        (it runs on, its outcome dropped)."""
        return await trio.to_thread.run_sync(self.call, fn, *args, abandon_on_cancel=True)

    def call(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` here (a worker thread the caller may abandon), never
        with the transport closed under it."""
        with self._lock:
            if self._closed:
                raise SinkClosed(f"{self._description} is closed")
            self._running += 1
        try:
            return fn(*args)
        finally:
            with self._lock:
                self._running -= 1
                last = self._closed and self._running == 0
            if last:
                self._close_now()

    def close(self) -> None:
        """Refuse later calls; close the transport now if no call runs, else
        when the last one returns (blocking: call it from a worker thread)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            idle = self._running == 0
        if idle:
            self._close_now()

    def wait_released(self, timeout: float | None = None) -> bool:
        """After :meth:`close`: wait (blocking) until the last call returned
        and the transport was closed; False if ``timeout`` seconds passed first."""
        return self._released.wait(timeout)

    def _close_now(self) -> None:
        close, self._close_transport = self._close_transport, None
        try:
            if close is not None:
                close()
        finally:
            self._released.set()


__all__ = ["AbandonableCalls"]
