"""A spooling destination's health and spool over /healthz, /status, /metrics,
and `taproute check` warning about an old spool."""

from __future__ import annotations

import json
import math
import threading
import time

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from taproute.actors import RoutingSink
from taproute.routing import Route, RoutingConfig
from taproute.service import HttpConfig, create_record_runtime
from taproute.service.host.cli import main
from taproute.service.sinks.spool import Spool, SpoolConfig
from taproute.service.sinks.spool.spooling import Backoff, SpoolingSink
from tests.conftest import vec_batch
from tests.processors import SCHEMA
from tests.test_config_file import base, unique, write
from tests.test_http import get


class DownSink:
    """Refuses every batch with a connection error while ``down``; else keeps them."""

    def __init__(self, expect: int) -> None:
        self.down = True
        self.records = 0
        self.expect = expect
        self.all_in = threading.Event()

    async def submit(self, batch) -> None:
        if self.down:
            raise ConnectionRefusedError("destination unreachable (injected)")
        self.records += len(batch)
        if self.records >= self.expect:
            self.all_in.set()

    async def flush(self) -> None:
        pass

    async def close(self) -> None:
        pass


def metric_samples(body: str) -> dict:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
    }


def test_an_unreachable_destination_is_degraded_with_since_and_why_then_recovers(tmp_path):
    inner = DownSink(expect=10)
    spooling = SpoolingSink(
        "cap",
        inner,
        Spool.open(SpoolConfig(directory=tmp_path / "spool")),
        backoff=Backoff(initial=0.01, maximum=0.05),
    )
    sink = RoutingSink(
        RoutingConfig([Route("raw", "layers.*", "cap")]),
        SCHEMA,
        {"cap": lambda: spooling},
        unmatched="drop",
    )
    before = time.time()
    with create_record_runtime(record_sink=sink, http=HttpConfig(port=0)) as runtime:
        (url,) = runtime.http_urls
        q = runtime.bind_hook("layers.0.q", layout="vec")
        for i in range(10):
            runtime.submit(q, np.full(4, i, np.float32))
        runtime.flush()  # returns while it is down: the records are durable in the spool

        status, body = get(f"{url}/healthz")
        health = json.loads(body)
        assert status == 200 and health["status"] == "degraded"
        cap = health["unhealthy_destinations"]["cap"]
        assert "unreachable" in cap["reason"] and before <= cap["since"] <= time.time()
        destination = json.loads(get(f"{url}/status")[1])["destinations"]["cap"]
        # JSON's false (it was 0); /metrics stays numeric.
        assert destination["healthy"] is False and destination["spool_bytes"] > 0
        samples = metric_samples(get(f"{url}/metrics")[1])
        label = (("destination", "cap"),)
        assert samples[("taproute_destination_healthy", label)] == 0
        assert samples[("taproute_destination_spool_bytes", label)] > 0
        assert samples[("taproute_destination_spool_segments", label)] == 1

        inner.down = False
        assert inner.all_in.wait(timeout=60)
        runtime.flush()
        assert get(f"{url}/healthz") == (200, '{"status":"ok"}')
        samples = metric_samples(get(f"{url}/metrics")[1])
        assert samples[("taproute_destination_healthy", label)] == 1
        destination = json.loads(get(f"{url}/status")[1])["destinations"]["cap"]
        assert destination["healthy"] is True
        assert samples[("taproute_destination_spool_drained_records_total", label)] == 10
        assert samples[("taproute_destination_spool_bytes", label)] == 0
    assert inner.records == 10


def test_check_warns_about_a_spool_older_than_ten_minutes(tmp_path, chdb_transport, capsys):
    import trio

    spool_dir = tmp_path / "spool"
    text = base(chdb_transport, unique("dr")).replace(
        'raw = ["vec"]\n', f'raw = ["vec"]\nspool_dir = "{spool_dir}"\n', 1
    )
    path = write(tmp_path, text)

    async def leave_an_old_batch() -> None:
        spool = Spool.open(SpoolConfig(directory=spool_dir), clock=lambda: time.time() - 1200)
        await spool.append(vec_batch(0, 3))
        await spool.aclose()

    trio.run(leave_an_old_batch)
    assert main(["check", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "WARNING: destination 'ch': spool" in out
    assert "1 undelivered batch group(s)" in out and "20 minutes old" in out


@pytest.mark.parametrize("block_timeout", [math.inf, None])
def test_a_full_blocking_spool_holds_a_capture_no_longer_than_max_block(tmp_path, block_timeout):
    # The destination is down and its spool full with when_full="block": with
    # no timeout (inf) it stops taking batches, its mailbox and then ingress
    # fill; with the default (None: the runtime's max_block) it sheds what
    # waited that long, counted, and then, the spool still full, each next
    # batch at once (the bound is per stall), so ingress need not fill.  A
    # capture (offer_batch) still returns within max_block, the records it
    # could not queue counted as shed, and nothing latches.
    from taproute.native import make_descriptors

    inner = DownSink(expect=10**9)
    config = SpoolConfig(
        directory=tmp_path / "spool", quota_bytes=1000, block_timeout=block_timeout
    )
    spooling = SpoolingSink(
        "cap",
        inner,
        Spool.open(config),
        backoff=Backoff(initial=0.01, maximum=0.05),
        drain_on_close=0.0,
    )
    sink = RoutingSink(
        RoutingConfig([Route("raw", "layers.*", "cap")]),
        SCHEMA,
        {"cap": lambda: spooling},
        unmatched="drop",
        destination_capacity=64,
    )
    runtime = create_record_runtime(record_sink=sink, capacity_records=64, max_block=0.05)
    q = runtime.bind_hook("layers.0.q", layout="vec")
    taken = refused = 0
    longest = 0.0
    for i in range(60):
        desc = make_descriptors(q, 16, count=8, layout_ids=SCHEMA.layout_id("vec"))
        started = time.monotonic()
        if runtime.offer_batch(desc, np.full((8, 4), i, np.float32)):
            taken += 8
        else:
            refused += 8
        longest = max(longest, time.monotonic() - started)
    counters = runtime.counters()
    assert counters.ingress.shed == refused and taken + refused == 480
    if block_timeout == math.inf:
        assert refused > 0  # a destination that waits for good fills ingress
    assert longest < 5.0  # bounded by max_block (0.05 s), with room for a loaded machine
    assert runtime.failure is None
    spool = spooling.snapshot().spool
    assert spool.appended_batches == 1 and spool.bytes > 0  # the rest wait for room
    inner.down = False  # the destination recovers: room again, everything taken drains
    # Waited for: close() leaves what is still spooled then for the next start
    # (drain_on_close=0), and nothing orders the drain's last group before it.
    runtime.flush(timeout=60, wait=True)
    runtime.close(timeout=60)
    shed = spooling.snapshot().shed_records  # by the spool, past its block timeout
    assert inner.records + shed == taken
    if block_timeout == math.inf:
        assert shed == 0
    else:
        assert shed > 0
