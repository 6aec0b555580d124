"""Capture hooks defer the loop wake-up: one wake-up for several hook calls.

A wake-up costs the model thread a socket write and hands the GIL to the loop
thread inside the forward pass; hook batches (``offer_batch``) wait instead
until they are ``wake_delay`` old, ingress fills, a producer must block, or a
flush/close arrives, and the record worker's poll takes them otherwise.
"""

from __future__ import annotations

import numpy as np

from taproute.native import make_descriptors
from taproute.routing.batch import RecordBatch
from taproute.service import create_record_runtime
from taproute.service.host.ingress import Ingress
from tests.processors import SCHEMA
from tests.sinks import NullSink
from tests.test_runtime import Q, eventually, routing_sink, vec_payload


def _ingress(wake_delay: float, capacity_records: int = 100) -> tuple[Ingress, list[int]]:
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


def _batch(records: int = 4) -> RecordBatch:
    desc = make_descriptors(0, 16, count=records)
    return RecordBatch.from_buffer(desc, vec_payload(records).tobytes())


def test_hook_batches_share_one_wake_up_until_they_are_old():
    ingress, wakes = _ingress(wake_delay=3600.0)
    for _ in range(10):
        assert ingress.offer_batch(_batch(), timeout=1.0, defer_wake=True)
    assert wakes == []  # ten hook calls, no wake-up yet
    assert ingress.deferred
    assert len(ingress.take()) == 10  # the record worker's poll takes them all
    assert not ingress.deferred


def test_an_old_deferred_batch_wakes_the_loop_at_the_next_call():
    ingress, wakes = _ingress(wake_delay=0.0)
    ingress.put_batch(_batch(), defer_wake=True)
    assert wakes == [1]
    ingress.put_batch(_batch(), defer_wake=True)
    assert wakes == [1]  # a wake-up is already pending: never a second one


def test_half_full_ingress_flush_and_plain_submits_wake_at_once():
    ingress, wakes = _ingress(wake_delay=3600.0, capacity_records=16)
    ingress.put_batch(_batch(4), defer_wake=True)
    assert wakes == []
    ingress.put_batch(_batch(4), defer_wake=True)  # 8 of 16 records: half full
    assert wakes == [1]
    ingress.take()
    ingress.put_batch(_batch(1), defer_wake=True)
    ingress.put_control("flush")
    assert wakes == [1, 1]
    ingress.take()
    ingress.put_batch(_batch(1))  # submit_batch: not a hook, wakes at once
    assert wakes == [1, 1, 1]


def test_deferred_hook_batches_arrive_without_a_flush():
    sink = NullSink()
    with create_record_runtime(record_sink=routing_sink({"cap": sink})) as runtime:
        q = runtime.bind_hook(Q, layout="vec")
        desc = make_descriptors(q, 16, count=8, layout_ids=SCHEMA.layout_id("vec"))
        assert runtime.offer_batch(desc, vec_payload(8))
        eventually(lambda: runtime.counters().destinations["cap"].records == 8)
    assert sink.records == 8
    assert np.all(np.asarray(sink.seen_payloads[0]).view(np.float32) == vec_payload(8).ravel())


def test_without_a_wake_delay_hook_batches_wake_the_loop_and_arrive():
    sink = NullSink()
    with create_record_runtime(record_sink=routing_sink({"cap": sink})) as runtime:
        ingress = runtime.offer_batch.__self__._ingress
        ingress.wake_delay = 0.0  # the behaviour before deferral: a wake-up per call
        q = runtime.bind_hook(Q, layout="vec")
        desc = make_descriptors(q, 16, count=8, layout_ids=SCHEMA.layout_id("vec"))
        assert runtime.offer_batch(desc, vec_payload(8))
        eventually(lambda: runtime.counters().destinations["cap"].records == 8)
    assert sink.records == 8
