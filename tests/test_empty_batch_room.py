"""Empty batches cannot grow ingress: memory stays bounded while the router is stalled.

An empty ``submit_batch`` (zero records) was queued whatever ingress held (it
took no room: room was counted in records and bytes), so a producer
submitting empty batches in a loop against a stalled destination grew the
ingress queue without bound.  Now an empty batch without a ``release`` is a
no-op queued nowhere (refused only after close or a failure), and one with a
``release`` takes one record's room until the record worker ran its release
(on the loop thread, after what was queued before it), waiting for room as a
record does.

Every wait is on an event or the ingress's own state (``eventually`` is a
hang guard over state another thread changes).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from taproute.native import make_descriptors
from taproute.routing import IngressFull
from taproute.routing.batch import RecordBatch
from tests.test_key_control_room import (
    HANG_GUARD_S,
    _ingress,
    _stalled_runtime,
    _submit,
)
from tests.test_runtime import eventually


def _empty_batch(release=None) -> RecordBatch:
    return RecordBatch.from_buffer(make_descriptors(0, 16, count=0), b"", release)


def test_empty_batches_with_a_release_take_room_on_the_bare_ingress():
    ingress = _ingress(capacity=4)
    ingress.put_batch(_empty_batch(lambda: None))  # alone: always fits
    for _ in range(3):
        assert ingress.try_put_batch(_empty_batch(lambda: None))
    assert not ingress.try_put_batch(_empty_batch(lambda: None))  # full: 4 of 4
    assert ingress.queued_records == 0  # no records counted, only their room
    assert len(_drain_empty(ingress)) == 4
    assert ingress.try_put_batch(_empty_batch(lambda: None))  # room came back
    refusing = _ingress(when_full="reject", capacity=1)
    refusing.put_batch(_empty_batch(lambda: None))
    with pytest.raises(IngressFull):
        refusing.put_batch(_empty_batch(lambda: None))


def _drain_empty(ingress):
    items = ingress.take()
    ingress.done(0, 0, empty=sum(1 for i in items if isinstance(i, RecordBatch) and not len(i)))
    return items


def test_empty_submits_without_a_release_against_a_stalled_router_queue_nothing():
    runtime, stall, q = _stalled_runtime(capacity_records=16)
    try:
        for key in range(4):
            _submit(runtime, q, key)
        before = runtime._ingress._queued()
        empty = make_descriptors(q, 16, count=0, layout_ids=0)
        payload = np.zeros((0, 4), np.float32)
        for _ in range(5000):  # never waits: a no-op
            runtime.submit_batch(empty, payload)
            assert runtime.try_submit_batch(empty, payload)
            assert runtime.offer_batch(empty, payload)
        assert runtime._ingress._queued() == before
        assert len(runtime._ingress._queue) == 4
        stall.release.set()
        runtime.flush(timeout=HANG_GUARD_S)
        counters = runtime.counters()
        assert counters.ingress.submitted == 5 and counters.routes["sum"].processed == 4
    finally:
        stall.release.set()
        runtime.close(timeout=HANG_GUARD_S)


def test_empty_submits_with_a_release_against_a_stalled_router_stay_bounded_then_all_release():
    runtime, stall, q = _stalled_runtime(capacity_records=16)
    released: list[int] = []
    try:
        for key in range(4):
            _submit(runtime, q, key)
        empty = make_descriptors(q, 16, count=0, layout_ids=0)
        payload = np.zeros((0, 4), np.float32)
        issued: list[int] = []
        finished = threading.Event()

        def producer() -> None:
            for n in range(3000):
                runtime.submit_batch(empty, payload, release=lambda n=n: released.append(n))
                issued.append(n)
            finished.set()

        thread = threading.Thread(target=producer, daemon=True)
        thread.start()
        eventually(
            lambda: runtime._ingress.counters.blocked_producers == 1 or finished.is_set(),
            timeout=HANG_GUARD_S,
        )
        assert not finished.is_set()  # before: all 3000 queued past the bound
        assert len(issued) == 12  # 4 records + 12 empty batches: 16 of 16
        assert runtime._ingress._queued() == 16 and len(runtime._ingress._queue) == 16
        assert released == []
        stall.release.set()
        assert finished.wait(HANG_GUARD_S)
        thread.join(HANG_GUARD_S)
        runtime.flush(timeout=HANG_GUARD_S)
        assert released == list(range(3000))  # each once, in order
        assert runtime._ingress._queued() == 0
        assert runtime.counters().ingress.batches == 5  # empty ones are no batches
    finally:
        stall.release.set()
        runtime.close(timeout=HANG_GUARD_S)
