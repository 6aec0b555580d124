"""/healthz, /metrics and /status answer while a producer thread holds
ingress full and the destination keeps the runtime's loop busy; ``POST
/reload`` on a saturated router answers within its wait (202 while its swap is
queued behind the ingress) and its generation routes in order.

Prometheus scrapes with a 10 s timeout, Kubernetes probes often with 1 s: the
endpoint must answer exactly when the router is busiest.  A destination whose
submits take loop time (Python work per batch, as a sink building Arrow
tables does) once starved the HTTP tasks: the record worker ran a whole
ingress (65,536 records) between two schedule points, a destination actor
64 submits, and a request that needs about ten trips through the scheduler
waited for about ten of those runs (3 s per /healthz here).  And a reload,
ordered behind what ingress holds, answered only once a slow destination had
taken all of it (22 s in a fault probe), past any client's timeout.

The loop's tasks now hand it over by time; the answers still share the GIL
with the producer thread and the destination's Python work, so with ingress
really full (held until it is, then worked through) they take up to a few
seconds on this machine: the bound asserted is well within Prometheus's
10 s scrape timeout, not a probe's 1 s.
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
import trio

from taproute.actors import RoutingSink
from taproute.native import make_descriptors
from taproute.routing import Batch, Route, RoutingConfig
from taproute.service import HttpConfig, RecordService, create_record_runtime
from taproute.service.host.config import load_config
from taproute.service.host.reload import ConfigReloader
from tests.processors import SCHEMA
from tests.sinks import HeldInThread
from tests.test_reload_service import NORMS, RAW, config_text

#: Loop time each submit of the busy destination takes (2 ms per 256 records:
#: ingress holds 256 of those batches).
BUSY_S = 0.002

#: What every /healthz, /metrics and /status answer at saturation must come
#: within (half Prometheus's default scrape timeout).
ANSWER_WITHIN_S = 5.0

#: Ingress capacity (records) of the reload test.
RELOAD_INGRESS = 4096

#: And what the median answer must come within.
MEDIAN_WITHIN_S = 2.0


class BusyOnLoop:
    """A destination whose every submit holds the runtime's loop (and the GIL)
    for ``seconds``: Python work per batch, done on the loop.  With a
    ``gate``, submits wait (off the loop) until it is set."""

    def __init__(self, seconds: float, gate: threading.Event | None = None) -> None:
        self.seconds = seconds
        self.gate = gate
        self.records = 0

    async def submit(self, batch: Batch) -> None:
        if self.gate is not None and not self.gate.is_set():
            await trio.to_thread.run_sync(self.gate.wait)
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


def timed_get(url: str, *, post: bool = False) -> tuple[float, int, str]:
    """Seconds to the whole answer, its status and body (a POST with the token)."""
    request = (
        urllib.request.Request(
            url, data=b"", method="POST", headers={"Authorization": "Bearer s3cret"}
        )
        if post
        else urllib.request.Request(url)
    )
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            code, body = response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        code, body = error.code, error.read().decode()
    return time.perf_counter() - started, code, body


def test_endpoints_answer_promptly_while_ingress_is_full_and_the_loop_busy():
    # Held at first (the gate), so the producers fill ingress whatever share
    # of the GIL they get: the busy destination alone drains faster than
    # producers starved by it refill, on a quiet machine.  Its mailbox takes
    # a few batches, so what waits is in ingress.
    out = BusyOnLoop(BUSY_S, gate=threading.Event())
    sink = RoutingSink(
        RoutingConfig([Route("raw", "layers.*", "out")]),
        SCHEMA,
        {"out": out},
        unmatched="drop",
        destination_capacity=1024,
    )
    with create_record_runtime(record_sink=sink, http=HttpConfig(port=0)) as runtime:
        (url,) = runtime.http_urls
        took: dict[str, list[float]] = {"/healthz": [], "/metrics": [], "/status": []}
        queued: list[int] = []
        # One producer: more would take the GIL from this test's own client
        # thread, whose requests then wait for it, not for the loop.
        with saturated(runtime, producers=1):
            # Ingress full: from here the loop works through all of it (the
            # starvation this guards against ran a whole ingress between two
            # schedule points) while the producer refills it.
            out.gate.set()
            for _ in range(5):
                for path, times in took.items():
                    queued.append(runtime.counters().ingress.queued)
                    seconds, code, body = timed_get(url + path)
                    assert code == 200, body
                    times.append(seconds)
                    if path == "/healthz":
                        assert json.loads(body) == {"status": "ok"}
        # The first request went out with ingress full and the loop about to
        # work through it.
        assert queued[0] >= 65_536 // 2, queued
        runtime.flush()
        assert out.records == runtime.counters().ingress.submitted
    report = {path: [round(s, 3) for s in times] for path, times in took.items()}
    for times in took.values():
        assert max(times) <= ANSWER_WITHIN_S, report
        assert statistics.median(times) <= MEDIAN_WITHIN_S, report


def test_a_reload_at_saturation_answers_within_its_wait_and_routes_in_order(tmp_path):
    path = tmp_path / "router.toml"
    path.write_text(config_text(tmp_path, RAW))
    config = load_config(path)
    held = HeldInThread()  # the file's destination, held: nothing leaves ingress
    # Its mailbox takes a few batches, not 262,144 records (the default): the
    # records ingress holds once full are all ahead of a reload queued then,
    # and the record worker blocks before it reaches them all.
    sink = RoutingSink(
        config.routing_config(),
        SCHEMA,
        {"ch": held},
        unmatched="drop",
        destination_capacity=1024,
    )
    http = HttpConfig(port=0, token="s3cret")
    # Ingress of 4,096 records: filled by single records (to its last record's
    # room) in a moment, and routed through both generations as quickly.
    with create_record_runtime(
        record_sink=sink, http=http, capacity_records=RELOAD_INGRESS
    ) as runtime:
        runtime.reloader = ConfigReloader(runtime, config)
        (url,) = runtime.http_urls
        path.write_text(config_text(tmp_path, RAW + NORMS))
        hook = runtime.bind_hook("layers.0.q", layout="vec")
        descriptors = make_descriptors(hook, 16, count=256, layout_ids=0)
        payload = np.zeros((256, 4), np.float32)
        try:
            # The destination holds the record worker: records wait behind it,
            # ingress has room to spare.
            for _ in range(8):
                runtime.submit_batch(descriptors, payload)
            assert held.entered.wait(60)
            # Checked, queued behind those records, answered at once.
            seconds, code, body = timed_get(f"{url}/reload?wait=0", post=True)
            assert seconds <= ANSWER_WITHIN_S
            assert (code, json.loads(body)) == (
                202,
                {"status": "queued", "reload_id": 1, "running_generation": 1, "queued_reloads": 1},
            )
            # A wait is bounded: past it the answer says queued, and the reload goes on.
            seconds, code, body = timed_get(f"{url}/reload?wait=0.2", post=True)
            assert seconds <= 0.2 + ANSWER_WITHIN_S
            answer = json.loads(body)
            assert (code, answer["reload_id"], answer["queued_reloads"]) == (202, 2, 2)
            # Producers of single records: ingress full to the last record's room.
            with saturated(runtime, batch=1):
                try:
                    # Ingress full and not moving: a reload's control (it takes one
                    # record's room) cannot even be queued within the wait: 503,
                    # nothing queued, the running generation going on.
                    seconds, code, body = timed_get(f"{url}/reload?wait=0.2", post=True)
                    assert seconds <= 0.2 + ANSWER_WITHIN_S
                    answer = json.loads(body)
                    assert code == 503 and "reload not queued" in answer["error"], body
                    assert (answer["running_generation"], answer["queued_reloads"]) == (1, 2)
                    assert answer["reload_id"] == 3
                    # A file with problems is refused at once, whatever is queued.
                    path.write_text(config_text(tmp_path, RAW.replace('"ch"', '"nowhere"')))
                    seconds, code, body = timed_get(f"{url}/reload", post=True)
                    assert seconds <= ANSWER_WITHIN_S
                    assert code == 422 and "unknown destination 'nowhere'" in body
                    path.write_text(config_text(tmp_path, RAW + NORMS))
                    for wait in ("-1", "nan", "inf", "soon"):
                        assert timed_get(f"{url}/reload?wait={wait}", post=True)[1] == 400
                    seconds, code, body = timed_get(f"{url}/status")
                    assert seconds <= ANSWER_WITHIN_S
                    status = json.loads(body)
                    assert (status["generation"], status["ingress"]["queued_reloads"]) == (1, 2)
                    assert list(status["routes"]) == ["raw"]
                    assert status["ingress"]["queued"] >= RELOAD_INGRESS // 2
                    metrics = timed_get(f"{url}/metrics")[2]
                    assert "taproute_ingress_queued_reloads 2.0" in metrics
                finally:
                    # The producers blocked for room get it only from the
                    # destination: released before they are stopped.
                    held.release.set()
        finally:
            held.release.set()
        runtime.flush()  # queued after both reloads: they ran, in order, before it
        status = json.loads(timed_get(f"{url}/status")[2])
        assert (status["generation"], status["ingress"]["queued_reloads"]) == (3, 0)
        assert list(status["routes"]) == ["raw", "norms"]
        # What came of each: the two queued applied, in order, after their 202s;
        # the 503 never queued; the bad file refused at its check.
        assert [(r["id"], r["outcome"], r["generation"]) for r in status["reloads"]["recent"]] == [
            (1, "applied", 2),
            (2, "applied", 3),
            (3, "not_queued", None),
            (4, "refused", None),
        ]
        assert "ingress stayed full" in status["reloads"]["recent"][2]["error"]
        # Records submitted before the first reload went through generation 1
        # alone; those after it through raw and norms both.
        routes = status["routes"]
        assert routes["raw"]["processed"] == status["ingress"]["submitted"]
        assert 0 < routes["norms"]["processed"] < status["ingress"]["submitted"]
        # Not saturated: the answer waits for the swap and says which generation.
        assert timed_get(f"{url}/reload", post=True)[1:] == (200, '{"generation":4}')
