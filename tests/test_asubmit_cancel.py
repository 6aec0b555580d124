"""``asubmit_batch`` cancelled while it waits for ingress room (an
``asyncio.wait_for`` that ran out, a client gone) queues nothing: the caller
was told it did not happen. It used to go on waiting in the executor thread
and queue the batch later, so records the caller saw fail were delivered
anyway (a retry doubled them), and the thread stayed blocked (``asyncio.run``
hung at shutdown while the destination stalled)."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from taproute.native import make_descriptors
from taproute.routing import Route, RoutingConfig
from taproute.service import RoutingSink, create_record_runtime
from tests.processors import SCHEMA
from tests.sinks import StallsLoop

VEC = SCHEMA.layout_id("vec")


def test_a_cancelled_asubmit_batch_queues_nothing_and_frees_its_thread():
    stall = StallsLoop()
    sink = RoutingSink(
        RoutingConfig([Route("raw", "h.*", "out")]), SCHEMA, {"out": stall}, unmatched="drop"
    )
    runtime = create_record_runtime(record_sink=sink, capacity_records=8)
    released: list[int] = []
    try:
        hook = runtime.bind_hook("h.0", layout="vec")

        async def submit_all() -> tuple[list[int], int]:
            taken, timed_out = [], 0
            for key in range(10):
                desc = make_descriptors(hook, 16, count=4, keys=key, layout_ids=VEC)
                call = runtime.asubmit_batch(
                    desc, np.zeros((4, 4), np.float32), release=lambda k=key: released.append(k)
                )
                try:
                    await asyncio.wait_for(call, 0.05)
                except TimeoutError:
                    timed_out += 1
                else:
                    taken.append(key)
            return taken, timed_out

        executor = ThreadPoolExecutor(4)
        loop = asyncio.new_event_loop()
        loop.set_default_executor(executor)
        try:
            taken, timed_out = loop.run_until_complete(submit_all())
        finally:
            loop.close()
        # A wait left behind by a cancelled call would hold its executor thread
        # until the destination recovers (asyncio.run's end hung on it).
        shutdown = threading.Thread(target=executor.shutdown)
        shutdown.start()
        shutdown.join(10)
        assert not shutdown.is_alive(), "an executor thread still waits for ingress room"
        assert timed_out > 0  # the loop is stalled: ingress (8 records) filled
        stall.release.set()
        report = runtime.flush()
        assert report is not None
        assert report.routes["raw"].accepted == 4 * len(taken)
        assert report.routes["raw"].delivered == 4 * len(taken)
        assert stall.records == 4 * len(taken)
    finally:
        stall.release.set()
        runtime.close()
    assert sorted(released) == taken  # a withdrawn batch's buffer was never taken
