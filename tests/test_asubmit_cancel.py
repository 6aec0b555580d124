"""``asubmit_batch`` cancelled while it waits for ingress room (an
``asyncio.wait_for`` that ran out, a client gone) queues nothing: the caller
was told it did not happen. It used to go on waiting in the executor thread
and queue the batch later, so records the caller saw fail were delivered
anyway (a retry doubled them), and the thread stayed blocked (``asyncio.run``
hung at shutdown while the destination stalled)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
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

        def batch(key: int) -> tuple[np.ndarray, np.ndarray, Callable[[], None]]:
            desc = make_descriptors(hook, 16, count=4, keys=key, layout_ids=VEC)
            return desc, np.zeros((4, 4), np.float32), lambda: released.append(key)

        # The loop stalled in the destination, then ingress filled: nothing
        # makes room while the calls below wait, so every one of them times
        # out (a call whose wait ended just as its batch was queued, which
        # asubmit_batch leaves queued, cannot happen here).
        runtime.submit_batch(*batch(0))
        assert stall.stalled.wait(10)
        taken = [0]
        while runtime.try_submit_batch(*batch(len(taken))):
            taken.append(len(taken))

        async def submit_all() -> int:
            timed_out = 0
            for key in range(len(taken), len(taken) + 6):
                try:
                    await asyncio.wait_for(runtime.asubmit_batch(*batch(key)), 0.05)
                except TimeoutError:
                    timed_out += 1
            return timed_out

        executor = ThreadPoolExecutor(4)
        loop = asyncio.new_event_loop()
        loop.set_default_executor(executor)
        try:
            timed_out = loop.run_until_complete(submit_all())
        finally:
            loop.close()
        # A wait left behind by a cancelled call would hold its executor thread
        # until the destination recovers (asyncio.run's end hung on it).
        shutdown = threading.Thread(target=executor.shutdown)
        shutdown.start()
        shutdown.join(10)
        assert not shutdown.is_alive(), "an executor thread still waits for ingress room"
        assert timed_out == 6  # the loop is stalled: ingress (8 records) filled
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
