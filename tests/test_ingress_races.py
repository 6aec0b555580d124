"""Races between several producer threads and the record worker at ingress.

Every wait here is on an event or the ingress's own state; real-time bounds
are hang guards only (a lost wake-up shows as a batch never delivered).
"""

from __future__ import annotations

import threading

from taproute.native import make_descriptors
from taproute.routing.batch import RecordBatch
from taproute.service import create_record_runtime
from taproute.service.host.ingress import Ingress
from tests.processors import SCHEMA
from tests.sinks import NullSink
from tests.test_runtime import Q, eventually, routing_sink, vec_payload

HANG_GUARD_S = 60.0


class KeyCountSink(NullSink):
    """Counts the records it got per key (read by producer threads)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_key: dict[int, int] = {}

    async def submit(self, batch) -> None:
        for key in batch.descriptors["key"].tolist():
            self.by_key[key] = self.by_key.get(key, 0) + 1
        await super().submit(batch)


def _one(key: int, step: int) -> RecordBatch:
    desc = make_descriptors(0, 16, count=1, keys=key, steps=step)
    return RecordBatch.from_buffer(desc, bytes(16))


def test_a_worker_that_parks_between_every_hook_batch_never_misses_one():
    """Each producer offers a batch only once its previous one was delivered,
    half of them only once the worker parked (it parks after one empty poll),
    the others racing its decision to park: a wake-up lost between park and
    append leaves a batch queued forever, and the hang guard fails the test."""
    producers, per_producer = 4, 150
    sink = KeyCountSink()
    with create_record_runtime(record_sink=routing_sink({"cap": sink})) as runtime:
        ingress = runtime._ingress
        ingress.wake_delay = 0.0005
        ingress.park_after = 0.0
        q = runtime.bind_hook(Q, layout="vec")
        vec = SCHEMA.layout_id("vec")
        start = threading.Barrier(producers)
        errors: list[BaseException] = []

        def produce(key: int) -> None:
            try:
                start.wait(HANG_GUARD_S)
                for sent in range(1, per_producer + 1):
                    if key % 2 == 0:  # offer into a parked worker; the others race its park
                        eventually(lambda: ingress._parked, timeout=HANG_GUARD_S)
                    desc = make_descriptors(q, 16, count=1, keys=key, layout_ids=vec)
                    assert runtime.offer_batch(desc, vec_payload(1))
                    eventually(lambda n=sent: sink.by_key.get(key, 0) == n, timeout=HANG_GUARD_S)
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)

        threads = [
            threading.Thread(target=produce, args=(i,), daemon=True) for i in range(producers)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(2 * HANG_GUARD_S)
            assert not thread.is_alive()
        assert errors == []
    assert sink.by_key == dict.fromkeys(range(producers), per_producer)
    counters = runtime.counters().ingress
    assert counters.submitted == producers * per_producer and counters.shed == 0


def test_bounded_offers_from_several_threads_count_every_record_once():
    """Producers offer with no wait at all (max_block 0) into a small ingress
    while a worker drains it: every offer is either queued and taken exactly
    once or refused and counted as shed, never both, never neither."""
    producers, per_producer = 4, 400
    ingress = Ingress(
        capacity_records=8, capacity_bytes=1 << 30, when_full="block", coalesce_records=64
    )
    ingress.connect(lambda: None)
    start = threading.Barrier(producers + 1)
    accepted = [[] for _ in range(producers)]
    refused = [0] * producers
    finished = threading.Event()
    left = [producers]
    left_lock = threading.Lock()

    def produce(key: int) -> None:
        start.wait(HANG_GUARD_S)
        for step in range(per_producer):
            if ingress.offer_batch(_one(key, step), 0.0, defer_wake=True):
                accepted[key].append(step)
            else:
                refused[key] += 1
        with left_lock:
            left[0] -= 1
            if not left[0]:
                finished.set()

    threads = [threading.Thread(target=produce, args=(k,), daemon=True) for k in range(producers)]
    for thread in threads:
        thread.start()
    start.wait(HANG_GUARD_S)
    seen: dict[int, list[int]] = {k: [] for k in range(producers)}
    while True:
        done_before = finished.is_set()
        items = ingress.take()
        for item in items:
            assert isinstance(item, RecordBatch)
            seen[int(item.descriptors["key"][0])].append(int(item.descriptors["step"][0]))
        ingress.done(len(items), 16 * len(items))
        if done_before and not items:
            break
    for thread in threads:
        thread.join(HANG_GUARD_S)
        assert not thread.is_alive()
    assert seen == {k: accepted[k] for k in range(producers)}
    counters = ingress.snapshot()
    assert counters.submitted == sum(len(a) for a in accepted)
    assert counters.shed == sum(refused)
    assert counters.submitted + counters.shed == producers * per_producer
    assert counters.queued == 0 and counters.blocked_producers == 0


def test_blocked_producers_of_a_full_ingress_all_get_through():
    """Several producers block (no bound) on a one-batch ingress; the worker
    takes one item at a time: every producer is woken in turn, nothing is
    lost, each producer's order is kept."""
    producers, per_producer = 4, 100
    ingress = Ingress(
        capacity_records=1, capacity_bytes=1 << 30, when_full="block", coalesce_records=64
    )
    ingress.connect(lambda: None)
    start = threading.Barrier(producers + 1)

    def produce(key: int) -> None:
        start.wait(HANG_GUARD_S)
        for step in range(per_producer):
            ingress.put_batch(_one(key, step), defer_wake=True)

    threads = [threading.Thread(target=produce, args=(k,), daemon=True) for k in range(producers)]
    for thread in threads:
        thread.start()
    start.wait(HANG_GUARD_S)
    seen: dict[int, list[int]] = {k: [] for k in range(producers)}
    received = 0
    while received < producers * per_producer:
        items = ingress.take()
        for item in items:
            seen[int(item.descriptors["key"][0])].append(int(item.descriptors["step"][0]))
        received += len(items)
        ingress.done(len(items), 16 * len(items))
        if not items:
            eventually(lambda: ingress.deferred, timeout=HANG_GUARD_S)
    for thread in threads:
        thread.join(HANG_GUARD_S)
        assert not thread.is_alive()
    assert seen == {k: list(range(per_producer)) for k in range(producers)}
    assert ingress.snapshot().queued == 0
