"""A ClickHouse server that hangs after the sink was built (SIGSTOP: the
kernel still takes connections, nothing answers) costs a destination without
a spool ``(attempts + 1) x connect_timeout`` plus its ``Retry`` waits, not
``attempts x send_receive_timeout``; meanwhile it reads unhealthy, naming
the server and the cause; then ``flush()`` and ``close()`` raise the latched
failure naming destination, server and cause, with the rows counted given up.

Before, each attempt waited out clickhouse-connect's read timeout
(``send_receive_timeout``, 300 s unless the URL sets it) and every retry
did it again: a probe's plain server sink took over 60 s to give up (40
minutes with the defaults) while ``/healthz`` said ok.  Now a call
unanswered for ``connect_timeout`` asks the server (``GET /ping``, within
``connect_timeout``) and is abandoned when that goes unanswered too, and a
retry after it asks first instead of sending the block again.

Real parts: chfacade (ClickHouse's HTTP interface on chDB) in a child
process, clickhouse-connect over loopback, the runtime's HTTP endpoint.
Nothing waits by sleeping: the stop is a signal, the flush runs in a thread
whose progress is read from the counters."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import urllib.request

import pytest

from taproute.routing import Route, RoutingConfig, RoutingFailure
from taproute.service import ClickHouseSink, HttpConfig, RoutingSink, create_record_runtime
from taproute.service.sinks.clickhouse import Retry
from tests.test_latched_accounting import RECORDS, SCHEMA, _submit
from tests.test_runtime import eventually

CONNECT_S = 1
#: Far longer than the test may take: it must not be what ends the attempts.
SEND_RECEIVE_S = 600
ATTEMPTS = 3
BACKOFF_S = 0.05
#: What a loaded machine may add to the bound (thread hops, a slow ping's refusal).
SLACK_S = 6.0
GUARD_S = 120


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=GUARD_S) as reply:
        return json.loads(reply.read().decode())


def test_a_hung_server_is_given_up_within_connect_timeout_and_reads_unhealthy(facade):
    url = f"{facade.url}?connect_timeout={CONNECT_S}&send_receive_timeout={SEND_RECEIVE_S}"
    shown = facade.url  # the URL without its parameters, as messages show it
    sink = ClickHouseSink.server(
        SCHEMA,
        url,
        raw=["acts"],
        create_tables=True,
        retry=Retry(attempts=ATTEMPTS, initial_backoff=BACKOFF_S, max_backoff=BACKOFF_S),
    )
    routing = RoutingSink(
        RoutingConfig([Route("to_ch", "h.*", "ch")]), SCHEMA, {"ch": lambda: sink}, unmatched="drop"
    )
    runtime = create_record_runtime(record_sink=routing, http=HttpConfig(port=0))
    server = facade.process
    assert server is not None
    stopped = False
    try:
        (base,) = runtime.http_urls
        hook = runtime.bind_hook("h.0", layout="acts")
        _submit(runtime, hook, 1)
        runtime.flush()
        status = get(f"{base}/status")["destinations"]["ch"]
        assert status["healthy"] is True  # a server sink reports its health without a spool
        assert get(f"{base}/healthz") == {"status": "ok"}

        os.kill(server.pid, signal.SIGSTOP)
        stopped = True
        _submit(runtime, hook, 2)
        outcome: list[BaseException | None] = []

        def flush() -> None:
            try:
                runtime.flush(timeout=GUARD_S)
            except BaseException as exc:  # handed to the test's thread
                outcome.append(exc)
            else:
                outcome.append(None)

        started = time.monotonic()
        flushing = threading.Thread(target=flush)
        flushing.start()
        # The first attempt was abandoned: while the sink retries, it says why.
        eventually(lambda: runtime.counters().destinations["ch"].insert_errors >= 1, GUARD_S)
        health = get(f"{base}/healthz")
        if outcome:  # the retries may already be spent on a slow machine: then it failed
            assert health["status"] == "failed"
        else:
            assert health["status"] == "degraded", health
            reason = health["unhealthy_destinations"]["ch"]["reason"]
            assert reason.startswith(f"unreachable: ClickHouse server at {shown}: ")
            assert f"within {CONNECT_S} s (connect_timeout)" in reason
        flushing.join(GUARD_S)
        elapsed = time.monotonic() - started
        (error,) = outcome
        waits = (ATTEMPTS - 1) * BACKOFF_S
        # The first attempt: connect_timeout unanswered, then a ping as long;
        # each retry asks first, within connect_timeout.
        assert elapsed < (ATTEMPTS + 1) * CONNECT_S + waits + SLACK_S, elapsed
        assert isinstance(error, RoutingFailure)
        text = str(error)
        assert "clickhouse table 'raw_acts'" in text  # the destination's table
        assert f"into ClickHouse server at {shown} after {ATTEMPTS} attempt(s)" in text
        assert f"no answer within {CONNECT_S} s (connect_timeout)" in text  # the cause

        destination = runtime.counters().destinations["ch"]
        assert destination.given_up_records == RECORDS  # taken, never written: counted
        assert destination.insert_errors == ATTEMPTS
        assert destination.healthy is False
        assert destination.unhealthy_reason is not None
        assert shown in destination.unhealthy_reason
        metrics = urllib.request.urlopen(f"{base}/metrics", timeout=GUARD_S).read().decode()
        assert 'taproute_destination_healthy{destination="ch"} 0.0' in metrics
        closing = time.monotonic()
        with pytest.raises(RoutingFailure):
            runtime.close()
        # Close does not wait for the abandoned calls (send_receive_timeout).
        assert time.monotonic() - closing < CONNECT_S + SLACK_S
    finally:
        if stopped:
            os.kill(server.pid, signal.SIGCONT)
        with contextlib.suppress(RoutingFailure):
            runtime.close()
