"""The tests' thread-aware autojump clock: mock time stands still while a
worker thread runs, and jumps as Trio's own autojump does otherwise."""

from __future__ import annotations

import time

import trio
import trio.testing

from tests.thread_aware_clock import thread_aware_clock


async def _mock_seconds_during_a_thread() -> float:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.sleep, 10)  # a deadline the clock could jump to
        before = trio.current_time()
        await trio.to_thread.run_sync(time.sleep, 0.05)  # the thread's work: 50 ms
        during = trio.current_time() - before
        nursery.cancel_scope.cancel()
    return during


def test_mock_time_stands_still_while_a_worker_thread_runs():
    original = trio.to_thread.run_sync
    with thread_aware_clock() as clock:
        assert trio.run(_mock_seconds_during_a_thread, clock=clock) == 0
    assert trio.to_thread.run_sync is original  # unpatched after the block
    # Trio's own autojump jumps meanwhile: what made thread-bound tests flaky.
    plain = trio.testing.MockClock(autojump_threshold=0)
    assert trio.run(_mock_seconds_during_a_thread, clock=plain) == 10


def test_without_a_thread_in_flight_it_jumps_to_the_next_deadline():
    async def main() -> float:
        await trio.to_thread.run_sync(lambda: None)
        start = trio.current_time()
        await trio.sleep(3600)
        return trio.current_time() - start

    with thread_aware_clock() as clock:
        started = time.monotonic()
        assert trio.run(main, clock=clock) == 3600
    assert time.monotonic() - started < 60  # jumped, not waited (a hang guard)
