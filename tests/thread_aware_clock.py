"""A MockClock whose autojump waits for worker threads: mock time passes only
while every task waits on time, never while a worker thread computes.

Trio's autojump clock jumps to the next deadline whenever every task is
blocked, and a task waiting on ``trio.to_thread.run_sync`` counts as blocked
(python-trio/trio#456).  While a worker thread runs (a chDB insert, a
processor, a spool write), mock time then races ahead for as long as the
thread takes in real time: on a loaded machine a test's retries fall minutes
apart, deadlines fire, and what the test measures depends on the machine's
speed.  :func:`thread_aware_clock` counts the ``trio.to_thread.run_sync``
calls in flight (on the Trio side, so the count is exact at every schedule
point) and sets the clock's public ``autojump_threshold`` to infinity while
there is one, back to its value when the last one returns.

Not for a test that needs mock time to pass while a thread is blocked on
something only a timer releases: that test would wait for the thread instead.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import trio
import trio.testing


class ThreadCalls:
    """Counts ``trio.to_thread.run_sync`` calls in flight and holds ``clock``'s
    autojump while there is one."""

    def __init__(self, clock: trio.testing.MockClock, threshold: float) -> None:
        self.clock = clock
        self.threshold = threshold
        self.in_flight = 0

    def wrap(self, run_sync: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        @functools.wraps(run_sync)
        async def counted(*args: Any, **kwargs: Any) -> Any:
            self.in_flight += 1
            self.clock.autojump_threshold = math.inf
            try:
                return await run_sync(*args, **kwargs)
            finally:
                self.in_flight -= 1
                if not self.in_flight:
                    self.clock.autojump_threshold = self.threshold

        return counted


@contextmanager
def thread_aware_clock(threshold: float = 0.0) -> Iterator[trio.testing.MockClock]:
    """A ``MockClock(autojump_threshold=threshold)`` that does not jump while a
    ``trio.to_thread.run_sync`` call is in flight (patched for the block)."""
    clock = trio.testing.MockClock(autojump_threshold=threshold)
    original = trio.to_thread.run_sync
    trio.to_thread.run_sync = ThreadCalls(clock, threshold).wrap(original)  # type: ignore[assignment]
    try:
        yield clock
    finally:
        trio.to_thread.run_sync = original  # type: ignore[assignment]
