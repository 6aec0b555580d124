"""A ClickHouse server that hangs (SIGSTOP: it takes connections and never
answers) while a model runs with capture, then goes on: from the model's
side, no forward pass raises or waits on telemetry, ``runtime.flush()``
returns (the inserts in flight are handed to the spool after the sink's
``close_timeout``), ``/status`` and ``/metrics`` report the destination
unhealthy, and once the server answers again every captured record is in
it exactly once.

Real parts: a GPT-2 (random weights), chfacade (ClickHouse's HTTP interface
on chDB) in a child process, clickhouse-connect, the runtime's HTTP
endpoint.  Nothing waits by sleeping: the stop is a signal, the recovery is
awaited with ``flush(wait=True)``."""

from __future__ import annotations

import json
import os
import signal
import urllib.request

import torch

from taproute.routing import RecordSchema, Route, RoutingConfig
from taproute.service import (
    ClickHouseSink,
    HttpConfig,
    RoutingSink,
    Spool,
    SpoolConfig,
    SpoolingSink,
    create_record_runtime,
)
from taproute.service.capture import bind_modules, capture_context
from taproute.service.sinks.clickhouse import ServerTransport
from taproute.service.sinks.spool.spooling import Backoff
from tests.capture_models import ACTS, VOCAB, gpt2

#: A hang guard, never a bound a slow machine could miss.
GUARD_S = 120
SCHEMA = RecordSchema([ACTS])


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=GUARD_S) as reply:
        return reply.read().decode()


def test_a_hung_server_costs_the_model_nothing_and_its_records_arrive_once(facade, tmp_path):
    inner = ClickHouseSink.server(
        SCHEMA, facade.url, raw=["acts"], create_tables=True, close_timeout=0.5
    )
    sink = SpoolingSink(
        "ch",
        inner,
        Spool.open(SpoolConfig(directory=tmp_path / "spool")),
        mode="outage",
        backoff=Backoff(initial=0.05, multiplier=2.0, maximum=0.5),
    )
    routing = RoutingSink(
        RoutingConfig([Route("raw", "*", "ch")]), SCHEMA, {"ch": lambda: sink}, unmatched="drop"
    )
    model = gpt2()
    ids = torch.randint(3, VOCAB, (4, 8))
    keys = iter(range(10_000))
    passes = 0

    def forward() -> None:
        nonlocal passes
        with torch.inference_mode(), capture_context([next(keys) for _ in range(4)]):
            model(ids)  # never raises
        passes += 1

    server = facade.process
    assert server is not None
    stopped = False
    runtime = create_record_runtime(record_sink=routing, max_block=5.0, http=HttpConfig(port=0))
    try:
        (base,) = runtime.http_urls
        bind_modules(runtime, model, "transformer.h.*.mlp", layout="acts")
        forward()
        runtime.flush()
        assert json.loads(get(f"{base}/status"))["destinations"]["ch"]["healthy"] is True

        os.kill(server.pid, signal.SIGSTOP)
        stopped = True
        for _ in range(10):
            forward()
        runtime.flush(timeout=GUARD_S)  # durable in the spool; not waiting for the server
        status = json.loads(get(f"{base}/status"))
        ch = status["destinations"]["ch"]
        assert ch["healthy"] is False
        assert "no answer within 0.5 s (close_timeout)" in ch["unhealthy_reason"]
        assert ch["spool_bytes"] > 0
        assert 'taproute_destination_healthy{destination="ch"} 0.0' in get(f"{base}/metrics")
        ingress = runtime.counters().ingress
        # Nothing shed, nothing dropped, the model never waited for room.
        assert ingress.shed == 0 and not ingress.dropped and ingress.blocked_seconds == 0
        assert ingress.submitted == passes * 4 * 2  # rows x hooks

        os.kill(server.pid, signal.SIGCONT)
        stopped = False
        forward()
        runtime.flush(timeout=GUARD_S, wait=True)  # and the spool has drained
        ch = json.loads(get(f"{base}/status"))["destinations"]["ch"]
        assert ch["healthy"] is True and ch["spool_bytes"] == 0
    finally:
        if stopped:
            os.kill(server.pid, signal.SIGCONT)
        runtime.close()
    snapshot = sink.snapshot()
    assert snapshot.delivered_records == snapshot.accepted_records == passes * 4 * 2
    assert snapshot.shed_records == 0 and snapshot.refused_records == 0
    transport = ServerTransport(facade.url)
    try:
        rows = transport.query("SELECT count() AS n, uniqExact(key, output_id) AS u FROM raw_acts")
    finally:
        transport.close()
    assert rows.to_pylist() == [{"n": passes * 4 * 2, "u": passes * 4 * 2}]
