"""Key controls take ingress room: memory stays bounded while the router is stalled.

``runtime.complete(key)`` (and cancel, reopen, and a ``capture_context``'s
``end_keys``) queued its control without ever waiting for room: a producer
completing keys in a loop against a stalled destination grew the ingress
queue without bound.  Each key control now takes one record's room until the
record worker ran it, and follows the runtime's ``when_full`` policy (block,
or refuse counted) and, at the end of a capture block, its ``max_block``
(shed, counted, the keys stay open), as records do; queued controls still run
after the records submitted before them.

Every wait is on an event or the ingress's own state (``eventually`` is a
hang guard over state another thread changes).
"""

from __future__ import annotations

import threading
import time

import pytest

from taproute.native import make_descriptors
from taproute.routing import IngressFull, Route
from taproute.routing.batch import RecordBatch
from taproute.routing.keys import KeyAction
from taproute.service import create_record_runtime
from taproute.service.capture import capture_context
from taproute.service.host.ingress import Ingress
from taproute.service.host.ingress_control import Control
from tests.sinks import NullSink, StallsLoop
from tests.test_runtime import Q, eventually, routing_sink, vec_payload

HANG_GUARD_S = 60.0
STALL = "layers.1.stall"


def _ingress(when_full: str = "block", capacity: int = 4) -> Ingress:
    ingress = Ingress(
        capacity_records=capacity, capacity_bytes=1 << 30, when_full=when_full, coalesce_records=64
    )
    ingress.connect(lambda: None)
    return ingress


def _batch(records: int, key: int = 0) -> RecordBatch:
    desc = make_descriptors(0, 16, count=records, keys=key)
    return RecordBatch.from_buffer(desc, bytes(16 * records))


def _drain(ingress: Ingress) -> list[object]:
    """Act as the record worker once: take everything, give its room back."""
    items = ingress.take()
    records = sum(len(i) for i in items if isinstance(i, RecordBatch))
    nbytes = sum(i.payload.nbytes for i in items if isinstance(i, RecordBatch))
    controls = sum(1 for i in items if isinstance(i, Control))
    ingress.done(records, nbytes, controls)
    return items


def test_completes_in_a_loop_block_on_a_full_ingress_and_come_out_in_order():
    ingress = _ingress(capacity=4)
    ingress.put_batch(_batch(4, key=99))  # full: the record worker is stalled
    issued: list[int] = []
    finished = threading.Event()

    def producer() -> None:
        for key in range(50):
            ingress.put_control(KeyAction.COMPLETE, (key,))
            issued.append(key)
        finished.set()

    thread = threading.Thread(target=producer, daemon=True)
    thread.start()
    eventually(lambda: ingress.counters.blocked_producers == 1 or finished.is_set())
    assert not finished.is_set() and issued == []  # before: all 50 queued at once
    seen: list[object] = []
    while len(seen) < 51:
        eventually(lambda: len(ingress._queue) > 0, timeout=HANG_GUARD_S)
        snapshot = ingress.snapshot()
        assert snapshot.queued + snapshot.queued_key_controls <= 4  # within the bound
        assert len(ingress._queue) <= 4
        seen.extend(_drain(ingress))
    assert finished.wait(HANG_GUARD_S)
    thread.join(HANG_GUARD_S)
    assert isinstance(seen[0], RecordBatch)  # the records queued first stay first
    assert [c.keys[0] for c in seen[1:]] == list(range(50))
    assert ingress.snapshot().queued_key_controls == 0


def test_reject_policy_refuses_a_control_on_a_full_ingress_and_counts_it():
    ingress = _ingress("reject", capacity=2)
    ingress.put_batch(_batch(2))
    refused = ingress.put_control(KeyAction.COMPLETE, (7,))
    with pytest.raises(IngressFull, match="complete of key\\(s\\) 7 refused: they stay open"):
        refused.result(0)
    counters = ingress.snapshot()
    assert counters.rejected_key_controls == 1 and counters.queued_key_controls == 0
    assert len(ingress._queue) == 1  # nothing queued for it
    _drain(ingress)
    later = ingress.put_control(KeyAction.COMPLETE, (7,))
    assert not later.done() and [c.keys for c in _drain(ingress)] == [(7,)]


def test_a_bounded_control_is_shed_past_max_block_once_per_stall_and_counted():
    ingress = _ingress(capacity=2)
    ingress.put_batch(_batch(2))
    first = ingress.put_control(KeyAction.COMPLETE, (1,), bounded=True, max_block=0.0)
    with pytest.raises(IngressFull, match="key\\(s\\) 1 not ended \\(shed\\): they stay open"):
        first.result(0)
    # The stall is known now: a later bounded control does not wait again,
    # however long its budget (this one would hang the test if it waited).
    second = ingress.put_control(KeyAction.CANCEL, (2,), bounded=True, max_block=3600.0)
    assert isinstance(second.exception(0), IngressFull)
    assert ingress.snapshot().shed_key_controls == 2
    _drain(ingress)  # the record worker moves again
    third = ingress.put_control(KeyAction.COMPLETE, (1,), bounded=True, max_block=0.0)
    assert not third.done() and [c.keys for c in _drain(ingress)] == [(1,)]


def _stalled_runtime(**options):
    """A runtime whose destination for ``STALL`` blocks the loop (its snapshot
    too, so a test reads the ingress's own counters while it stalls); ``Q``
    goes to a stateful route keeping keys."""
    stall = StallsLoop()
    sink = routing_sink(
        {"stall": stall, "cap": NullSink()},
        routes=[
            Route("stall", STALL, "stall"),
            Route("sum", Q, "cap", mode="stateful", processor="test.running_sum"),
        ],
        default_destination="stall",
    )
    runtime = create_record_runtime(record_sink=sink, **options)
    q = runtime.bind_hook(Q, layout="vec")
    s = runtime.bind_hook(STALL, layout="vec")
    runtime.submit_batch(make_descriptors(s, 16, count=1, layout_ids=0), vec_payload(1))
    assert stall.stalled.wait(HANG_GUARD_S)  # the loop is stuck in the destination
    return runtime, stall, q


def _submit(runtime, q: int, key: int) -> None:
    runtime.submit_batch(make_descriptors(q, 16, count=1, keys=key, layout_ids=0), vec_payload(1))


def test_a_producer_completing_keys_against_a_stalled_destination_blocks_then_all_apply():
    runtime, stall, q = _stalled_runtime(capacity_records=16)
    try:
        for key in range(10):
            _submit(runtime, q, key)  # 10 of 16 records' room
        issued: list[int] = []
        finished = threading.Event()

        def producer() -> None:
            for key in range(10):
                runtime.complete(key)
                issued.append(key)
            finished.set()

        thread = threading.Thread(target=producer, daemon=True)
        thread.start()
        eventually(
            lambda: runtime._ingress.counters.blocked_producers == 1 or finished.is_set(),
            timeout=HANG_GUARD_S,
        )
        ingress = runtime._ingress.snapshot()  # the loop is stuck: ingress's own counters
        assert not finished.is_set()  # before: the 10 completes queued past the bound
        assert (ingress.queued, ingress.queued_key_controls) == (10, 6)
        assert issued == list(range(6))
        stall.release.set()
        assert finished.wait(HANG_GUARD_S)
        thread.join(HANG_GUARD_S)
        runtime.flush(timeout=HANG_GUARD_S)
        route = runtime.counters().routes["sum"]
        # Each complete ran after its key's record: applied, then the key ended.
        assert route.completed_keys == 10 and route.terminal_records == 0
        _submit(runtime, q, 3)  # a completed key is terminal now
        runtime.flush(timeout=HANG_GUARD_S)
        assert runtime.counters().routes["sum"].terminal_records == 1
        assert runtime.counters().ingress.queued_key_controls == 0
    finally:
        stall.release.set()
        runtime.close(timeout=HANG_GUARD_S)


def test_reject_policy_refuses_a_complete_on_a_full_ingress_and_the_key_stays_open():
    runtime, stall, q = _stalled_runtime(capacity_records=4, when_full="reject")
    try:
        for _ in range(4):
            _submit(runtime, q, 5)
        with pytest.raises(IngressFull, match="refused: they stay open"):
            runtime.complete(5).result(HANG_GUARD_S)
        assert runtime._ingress.snapshot().rejected_key_controls == 1
        stall.release.set()
        runtime.flush(timeout=HANG_GUARD_S)
        route = runtime.counters().routes["sum"]
        assert route.completed_keys == 0 and route.open_keys == 1  # not ended
        runtime.complete(5).result(HANG_GUARD_S)
        runtime.flush(timeout=HANG_GUARD_S)
        assert runtime.counters().routes["sum"].completed_keys == 1
    finally:
        stall.release.set()
        runtime.close(timeout=HANG_GUARD_S)


def test_end_keys_of_a_capture_block_wait_at_most_max_block_then_are_shed_and_counted(caplog):
    max_block = 0.05
    runtime, stall, q = _stalled_runtime(capacity_records=2, max_block=max_block)
    try:
        _submit(runtime, q, 1)
        _submit(runtime, q, 2)
        started = time.perf_counter()
        with capture_context([1], end_keys=runtime):
            pass
        held = time.perf_counter() - started
        assert max_block <= held < HANG_GUARD_S  # waited its budget, no longer
        with capture_context([2], end_keys=runtime):  # the same stall: no second wait
            pass
        ingress = runtime._ingress.snapshot()  # the loop is stuck: ingress's own counters
        assert ingress.shed_key_controls == 2 and ingress.queued_key_controls == 0
        assert "not queued" in caplog.text and "shed_key_controls" in caplog.text
        stall.release.set()
        runtime.flush(timeout=HANG_GUARD_S)
        route = runtime.counters().routes["sum"]
        assert route.completed_keys == 0 and route.open_keys == 2  # they stay open
        with capture_context([1, 2], end_keys=runtime):  # room again: ends them
            pass
        runtime.flush(timeout=HANG_GUARD_S)
        assert runtime.counters().routes["sum"].completed_keys == 2
        assert runtime.counters().ingress.shed_key_controls == 2
    finally:
        stall.release.set()
        runtime.close(timeout=HANG_GUARD_S)
