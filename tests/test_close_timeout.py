"""``close(timeout=...)`` on a runtime whose destination does not finish:
bounded by the timeout it was given, saying what happened, and never
reporting a close that did not happen."""

from __future__ import annotations

import threading
import time

import pytest

from taproute.routing import Route, RoutingConfig
from taproute.service import RoutingSink, create_record_runtime
from tests.processors import SCHEMA
from tests.sinks import HeldFlush


def _runtime(held: HeldFlush):
    sink = RoutingSink(
        RoutingConfig([Route("raw", "h.*", "out")]), SCHEMA, {"out": held}, unmatched="drop"
    )
    return create_record_runtime(record_sink=sink)


def _loop_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "taproute"]


def test_a_close_that_times_out_says_so_within_its_timeout():
    held = HeldFlush()
    runtime = _runtime(held)
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=r"close: not done within 1.0 s"):
            runtime.close(timeout=1.0)
        # One timeout, not one for the close and another for joining the thread.
        assert time.monotonic() - started < 1.5
    finally:
        held.release.set()
        runtime.close()
    assert _loop_threads() == []


def test_a_second_close_does_not_report_a_close_still_under_way():
    held = HeldFlush()
    runtime = _runtime(held)
    try:
        with pytest.raises(TimeoutError):
            runtime.close(timeout=0.05)
        # The loop still runs (the destination's flush has not returned): a
        # second close that returned normally would say it was closed.
        with pytest.raises(TimeoutError, match=r"close: not done within 0.05 s"):
            runtime.close(timeout=0.05)
        assert _loop_threads() != []
    finally:
        held.release.set()
        runtime.close()  # waits for the close under way, then the thread
    assert _loop_threads() == []
    assert held.flushes >= 1
