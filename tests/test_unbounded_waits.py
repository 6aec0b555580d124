"""``max_block=math.inf`` (accepted: seconds >= 0) and ``flush``/``close``
timeouts of ``math.inf`` mean "wait as long as it takes". They raised
``OverflowError: timestamp out of range`` from the thread wait instead, into
the producer (a capture hook then detached) or the caller."""

from __future__ import annotations

import math
import threading

import numpy as np

from taproute.native import make_descriptors
from taproute.routing import Route, RoutingConfig
from taproute.service import RoutingSink, create_record_runtime
from tests.processors import SCHEMA
from tests.sinks import StallsLoop

VEC = SCHEMA.layout_id("vec")


def test_an_infinite_max_block_waits_for_room_and_sheds_nothing():
    held = StallsLoop()
    sink = RoutingSink(
        RoutingConfig([Route("raw", "h.*", "out", capacity=4)]),
        SCHEMA,
        {"out": held},
        unmatched="drop",
    )
    runtime = create_record_runtime(record_sink=sink, max_block=math.inf, capacity_records=4)
    try:
        hook = runtime.bind_hook("h.0", layout="vec")
        offered: list[object] = []

        def produce() -> None:
            try:
                for _ in range(12):
                    desc = make_descriptors(hook, 16, count=4, layout_ids=VEC)
                    offered.append(runtime.offer_batch(desc, np.zeros((4, 4), np.float32)))
            except Exception as exc:  # the defect: raised out of the wait
                offered.append(exc)

        producer = threading.Thread(target=produce)
        producer.start()
        # Until the producer waits for room (or, before the fix, died raising).
        # The ingress counters are read directly: snapshot() needs the loop,
        # which the destination holds.
        ingress = runtime._ingress.counters
        while ingress.blocked_producers == 0 and producer.is_alive():
            producer.join(0.005)
        assert producer.is_alive(), offered[-1:]
        held.release.set()
        producer.join(60)
        assert offered == [True] * 12
        report = runtime.flush(timeout=math.inf)
        assert report is not None and report.routes["raw"].delivered == 48
        assert runtime.counters().ingress.shed == 0
    finally:
        held.release.set()
        runtime.close(timeout=math.inf)
    assert held.records == 48
