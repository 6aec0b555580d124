"""``close(timeout=...)`` on a runtime whose destination does not finish:
bounded by the timeout it was given, saying what happened, and never
reporting a close that did not happen.

``HeldFlush`` waits in a worker thread that does not let itself be
abandoned: the loop cannot end until it returns, so close says the loop
thread is blocked (the ``abandon_on_cancel`` case is
``tests/test_shutdown_grace.py``)."""

from __future__ import annotations

import threading
import time

import pytest

from taproute.routing import Route, RoutingConfig, ShutdownAbandoned
from taproute.service import RoutingSink, create_record_runtime
from taproute.service.host.runtime import LOOP_END_S
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
        with pytest.raises(TimeoutError, match=r"close: the shutdown grace of 1 s ran out"):
            runtime.close(timeout=1.0)
        # The grace, and at most LOOP_END_S for a loop thread that cannot end.
        assert time.monotonic() - started < 1.0 + LOOP_END_S + 1.0
    finally:
        held.release.set()
    with pytest.raises(ShutdownAbandoned):
        runtime.close()
    assert _loop_threads() == []


def test_a_second_close_does_not_report_a_close_still_under_way():
    held = HeldFlush()
    runtime = _runtime(held)
    try:
        with pytest.raises(ShutdownAbandoned) as first:
            runtime.close(timeout=0.05)
        assert first.value.busy == {"out": "flush"} and not first.value.loop_ended
        # The loop still runs (the destination's flush has not returned): a
        # second close that returned normally would say it was closed.
        with pytest.raises(ShutdownAbandoned) as second:
            runtime.close(timeout=0.05)
        assert second.value is first.value
        assert _loop_threads() != []
    finally:
        held.release.set()
    with pytest.raises(ShutdownAbandoned):
        runtime.close()  # waits for the loop thread, then says the same again
    assert _loop_threads() == []
