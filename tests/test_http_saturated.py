"""/healthz, /metrics and /status answer promptly while producer threads hold
ingress full and the destination keeps the runtime's loop busy.

Prometheus scrapes with a 10 s timeout, Kubernetes probes often with 1 s: the
endpoint must answer exactly when the router is busiest.  A destination whose
submits take loop time (Python work per batch, as a sink building Arrow
tables does) once starved the HTTP tasks: the record worker ran a whole
ingress (65,536 records) between two schedule points, a destination actor
64 submits, and a request that needs about ten trips through the scheduler
waited for about ten of those runs (3 s per /healthz here).
"""

from __future__ import annotations

import contextlib
import json
import statistics
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import numpy as np

from taproute.actors import RoutingSink
from taproute.native import make_descriptors
from taproute.routing import Batch, Route, RoutingConfig
from taproute.service import HttpConfig, RecordService, create_record_runtime
from tests.processors import SCHEMA

#: Loop time each submit of the busy destination takes (2 ms per 256 records:
#: ingress holds 256 of those batches).
BUSY_S = 0.002

#: What every answer must come within, on a shared 2-core machine running
#: other jobs (answers took 1.8 to 4.8 s each before; about 50 ms now).
ANSWER_WITHIN_S = 1.0

#: And what the median answer must come within.
MEDIAN_WITHIN_S = 0.3


class BusyOnLoop:
    """A destination whose every submit holds the runtime's loop (and the GIL)
    for ``seconds``: Python work per batch, done on the loop."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.records = 0

    async def submit(self, batch: Batch) -> None:
        end = time.perf_counter() + self.seconds
        while time.perf_counter() < end:
            pass
        self.records += len(batch)

    async def flush(self) -> None:
        pass

    async def close(self) -> None:
        pass


@contextlib.contextmanager
def saturated(runtime: RecordService, producers: int = 4, batch: int = 256) -> Iterator[None]:
    """Producer threads submitting as fast as they can; entered once one of
    them found ingress full (and then blocked in ``submit_batch``)."""
    hook = runtime.bind_hook("layers.0.q", layout="vec")
    descriptors = make_descriptors(hook, 16, count=batch, layout_ids=0)
    payload = np.zeros((batch, 4), np.float32)
    stop = threading.Event()
    full = threading.Event()

    def produce() -> None:
        while not stop.is_set():
            if not runtime.try_submit_batch(descriptors, payload):
                full.set()
                runtime.submit_batch(descriptors, payload)

    threads = [threading.Thread(target=produce, name=f"producer {i}") for i in range(producers)]
    for thread in threads:
        thread.start()
    try:
        assert full.wait(60), "ingress never filled"
        yield
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)


def timed_get(url: str) -> tuple[float, int, str]:
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            code, body = response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        code, body = error.code, error.read().decode()
    return time.perf_counter() - started, code, body


def test_endpoints_answer_promptly_while_ingress_is_full_and_the_loop_busy():
    out = BusyOnLoop(BUSY_S)
    sink = RoutingSink(
        RoutingConfig([Route("raw", "layers.*", "out")]), SCHEMA, {"out": out}, unmatched="drop"
    )
    with create_record_runtime(record_sink=sink, http=HttpConfig(port=0)) as runtime:
        (url,) = runtime.http_urls
        took: dict[str, list[float]] = {"/healthz": [], "/metrics": [], "/status": []}
        with saturated(runtime):
            blocked_before = runtime.counters().ingress.blocked_seconds
            started = time.perf_counter()
            for _ in range(5):
                for path, times in took.items():
                    seconds, code, body = timed_get(url + path)
                    assert code == 200, body
                    times.append(seconds)
                    if path == "/healthz":
                        assert json.loads(body) == {"status": "ok"}
            elapsed = time.perf_counter() - started
        # Saturated all along: producers spent more time blocked for room
        # than the requests took (four producers: about four times as much).
        blocked = runtime.counters().ingress.blocked_seconds - blocked_before
        assert blocked >= elapsed, (blocked, elapsed)
        runtime.flush()
        assert out.records == runtime.counters().ingress.submitted
    report = {path: [round(s, 3) for s in times] for path, times in took.items()}
    for times in took.values():
        assert max(times) <= ANSWER_WITHIN_S, report
        assert statistics.median(times) <= MEDIAN_WITHIN_S, report
