"""The ingress handoff: producers append under a lock of their own, the record
worker takes without it, and a worker that found nothing parks until the next
batch wakes it.

No test here depends on timing: threads meet through events and the
ingress's own state; real-time bounds are hang guards only.
"""

from __future__ import annotations

import threading

import numpy as np

from taproute.native import make_descriptors
from taproute.routing.batch import RecordBatch
from taproute.service import create_record_runtime
from taproute.service.host.ingress import Ingress
from taproute.service.host.ingress_control import Control
from tests.processors import SCHEMA
from tests.sinks import NullSink
from tests.test_runtime import Q, eventually, routing_sink, vec_payload

HANG_GUARD_S = 60.0


def _ingress(capacity_records: int = 100, wake_delay: float = 3600.0) -> tuple[Ingress, list[int]]:
    ingress = Ingress(
        capacity_records=capacity_records,
        capacity_bytes=1 << 30,
        when_full="block",
        coalesce_records=64,
        wake_delay=wake_delay,
    )
    wakes: list[int] = []
    ingress.connect(lambda: wakes.append(1))
    return ingress, wakes


def _batch(records: int = 4, key: int = 0) -> RecordBatch:
    desc = make_descriptors(0, 16, count=records, keys=key)
    return RecordBatch.from_buffer(desc, vec_payload(records).tobytes())


def _run(target, *args) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread


def test_a_parked_worker_is_woken_once_by_the_next_hook_batch():
    ingress, wakes = _ingress()
    assert ingress.park()  # nothing queued: the worker may sleep without a poll
    ingress.put_batch(_batch(), defer_wake=True)
    assert wakes == [1]  # a hook batch wakes a parked worker
    ingress.put_batch(_batch(), defer_wake=True)
    assert wakes == [1]  # a wake-up is on its way: never a second one
    assert len(ingress.take()) == 2
    ingress.put_batch(_batch(), defer_wake=True)
    assert wakes == [1]  # polling again (not parked): hook batches wait for the poll


def test_park_refuses_when_something_is_queued_and_changes_nothing():
    ingress, wakes = _ingress()
    ingress.put_batch(_batch(), defer_wake=True)
    assert not ingress.park()  # the worker must take it instead of sleeping
    ingress.put_batch(_batch(), defer_wake=True)
    assert wakes == []  # not parked: still no wake-up from hooks
    ingress.put_record((0, 0, 0, 0, 0, 0, 0), b"\0" * 64)
    assert len(ingress.take()) == 3  # two batches, then the sealed record
    assert ingress.park()


def test_one_producers_records_batches_and_controls_come_out_in_its_order():
    ingress, _ = _ingress()
    first = _batch(2, key=1)
    ingress.put_record((0, 0, 0, 7, 0, 0, 0), b"\1" * 64)
    ingress.put_record((0, 0, 0, 8, 0, 0, 0), b"\2" * 64)
    ingress.put_batch(first, defer_wake=True)  # the two records are sealed first
    ingress.put_record((0, 0, 0, 9, 0, 0, 0), b"\3" * 64)
    future = ingress.put_control("flush")
    ingress.put_record((0, 0, 0, 10, 0, 0, 0), b"\4" * 64)
    items = ingress.take()
    assert len(items) == 5
    assert list(items[0].descriptors["key"]) == [7, 8]
    assert items[1] is first
    assert list(items[2].descriptors["key"]) == [9]
    assert isinstance(items[3], Control) and items[3].future is future
    assert list(items[4].descriptors["key"]) == [10]  # sealed by take(), last
    assert ingress.snapshot().queued == 2 + 2 + 1 + 1
    ingress.done(6, sum(item.payload.nbytes for item in items if isinstance(item, RecordBatch)))
    assert ingress.snapshot().queued == 0


def test_the_worker_takes_and_gives_room_back_without_the_producers_lock():
    ingress, _ = _ingress()
    ingress.put_batch(_batch(), defer_wake=True)
    taken: list[object] = []

    def worker() -> None:
        items = ingress.take()
        taken.extend(items)
        ingress.done(4, items[0].payload.nbytes)
        taken.append(ingress.park())

    with ingress._lock:  # a producer in the middle of a submit
        thread = _run(worker)
        thread.join(HANG_GUARD_S)
        assert not thread.is_alive(), "the record worker waited for the producers' lock"
    assert len(taken) == 2 and taken[1] is True
    assert ingress.snapshot().queued == 0


def test_room_given_back_wakes_a_blocked_producer():
    ingress, _ = _ingress(capacity_records=4)
    ingress.put_batch(_batch(4), defer_wake=True)  # full
    second = _batch(4)
    producer = _run(ingress.put_batch, second)
    eventually(lambda: ingress.snapshot().blocked_producers == 1, timeout=HANG_GUARD_S)
    items = ingress.take()
    ingress.done(4, items[0].payload.nbytes)
    producer.join(HANG_GUARD_S)
    assert not producer.is_alive()
    assert ingress.take() == [second]
    assert ingress.snapshot().queued == 4 and ingress.snapshot().blocked_producers == 0


def test_several_producer_threads_keep_their_order_and_every_count():
    producers, per_producer = 4, 200
    ingress, _ = _ingress(capacity_records=64)
    start = threading.Barrier(producers + 1)

    def produce(key: int) -> None:
        start.wait()
        for seq in range(per_producer):
            desc = make_descriptors(0, 16, count=1, keys=key, steps=seq)
            ingress.put_batch(RecordBatch.from_buffer(desc, bytes(16)), defer_wake=True)

    threads = [_run(produce, key) for key in range(producers)]
    start.wait()
    seen: dict[int, list[int]] = {key: [] for key in range(producers)}
    total = producers * per_producer
    received = 0
    while received < total:  # the worker's side, as the record worker runs it
        items = ingress.take()
        for item in items:
            assert isinstance(item, RecordBatch)
            seen[int(item.descriptors["key"][0])].append(int(item.descriptors["step"][0]))
        received += len(items)
        ingress.done(len(items), 16 * len(items))
        if not items:
            eventually(lambda: ingress.deferred, timeout=HANG_GUARD_S)
    for thread in threads:
        thread.join(HANG_GUARD_S)
        assert not thread.is_alive()
    assert seen == {key: list(range(per_producer)) for key in range(producers)}
    counters = ingress.snapshot()
    assert counters.submitted == counters.batches == total
    assert counters.queued == 0


def test_a_parked_runtime_loop_is_woken_by_a_hook_batch():
    sink = NullSink()
    with create_record_runtime(record_sink=routing_sink({"cap": sink})) as runtime:
        ingress = runtime.offer_batch.__self__._ingress
        ingress.wake_delay = 0.001
        ingress.park_after = 0.0
        eventually(lambda: ingress._parked, timeout=HANG_GUARD_S)  # a poll found nothing
        ingress.wake_delay = 3600.0  # no poll would come in time: only the wake-up
        q = runtime.bind_hook(Q, layout="vec")
        desc = make_descriptors(q, 16, count=8, layout_ids=SCHEMA.layout_id("vec"))
        assert runtime.offer_batch(desc, vec_payload(8))
        eventually(lambda: runtime.counters().destinations["cap"].records == 8)
    assert sink.records == 8
    assert np.all(np.asarray(sink.seen_payloads[0]).view(np.float32) == vec_payload(8).ravel())
