"""An unreachable ClickHouse server: refused at construction with a taproute
error naming the server (and the destination, where there is one); at
runtime an outage, which a spooling destination rides out and a plain sink
reports naming the server.

The runtime cases stop a real server (chfacade in a child process, SIGKILL)
and start it again on the same data and port."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import trio
from clickhouse_connect.driver.exceptions import OperationalError

from taproute.routing import HookRegistry, RoutingConfig, RoutingFailure
from taproute.routing.errors import ConfigError
from taproute.routing.routes import Route
from taproute.service import (
    ClickHouseSink,
    Retry,
    RoutingSink,
    ServerUnreachable,
    Spool,
    SpoolConfig,
    SpoolingSink,
    create_record_runtime,
)
from taproute.service.sinks.clickhouse import ServerTransport
from taproute.service.sinks.spool.spooling import Backoff
from tests.conftest import vec_batch
from tests.processors import SCHEMA

#: A hang guard, never a bound a slow machine could miss.
GUARD_S = 120


@pytest.fixture
def refusing_port() -> Iterator[int]:
    """A port bound but never listened on, held for the test: connections are
    refused, and no other process can take it meanwhile (a port freed again
    could be, on a busy machine)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        yield int(probe.getsockname()[1])


def test_an_unreachable_server_url_is_refused_naming_the_url_and_reason(refusing_port):
    url = f"http://127.0.0.1:{refusing_port}/default"
    with pytest.raises(ServerUnreachable) as caught:
        ClickHouseSink.server(SCHEMA, url, raw=["vec"])
    error = caught.value
    assert isinstance(error, ConfigError)
    assert str(error) == f"cannot reach ClickHouse server at {url} (to connect): Connection refused"
    assert error.target == f"ClickHouse server at {url}" and error.reason == "Connection refused"
    assert isinstance(error.__cause__, ConnectionRefusedError)  # the socket's error, kept


def test_credentials_in_the_url_stay_out_of_the_error(refusing_port):
    port = refusing_port
    with pytest.raises(ServerUnreachable) as caught:
        ServerTransport(f"http://ops:s3cret@127.0.0.1:{port}/db")
    assert "s3cret" not in str(caught.value)
    assert f"http://127.0.0.1:{port}/db" in str(caught.value)


def test_a_runtime_names_the_destination_whose_server_is_unreachable(refusing_port):
    url = f"http://127.0.0.1:{refusing_port}/default"
    hooks = HookRegistry()
    hooks.bind("q", layout="vec")
    sink = RoutingSink(
        RoutingConfig([Route("raw", "q", "ch")]),
        SCHEMA,
        {"ch": lambda: ClickHouseSink.server(SCHEMA, url, raw=["vec"])},
        hooks=hooks,
        unmatched="drop",
    )
    with pytest.raises(ServerUnreachable) as caught, create_record_runtime(record_sink=sink):
        pass
    expected = f"destination 'ch': cannot reach ClickHouse server at {url} (to connect): "
    assert str(caught.value).startswith(expected)
    assert caught.value.where == "destinations.ch"


def count(url: str) -> tuple[int, int]:
    transport = ServerTransport(url)
    try:
        table = transport.query("SELECT count() AS n, uniqExact(seq) AS u FROM raw_vec")
    finally:
        transport.close()
    row = table.to_pylist()[0]
    return int(row["n"]), int(row["u"])


def hooks_with_q() -> HookRegistry:
    hooks = HookRegistry()
    hooks.bind("q", layout="vec")
    return hooks


def test_a_given_client_whose_server_went_away_is_refused_naming_the_table(facade):
    import clickhouse_connect

    client = clickhouse_connect.get_client(dsn=facade.url, autogenerate_session_id=False)
    facade.kill()
    try:
        with pytest.raises(ServerUnreachable) as caught:
            ClickHouseSink.server(SCHEMA, client, raw=["vec"], create_tables=True)
    finally:
        client.close()
    assert "(to check table 'raw_vec'): Connection refused" in str(caught.value)


async def test_a_spooled_destination_rides_out_a_server_killed_at_runtime(facade, tmp_path):
    inner = ClickHouseSink.server(
        SCHEMA, facade.url, raw=["vec"], create_tables=True, hooks=hooks_with_q()
    )
    sink = SpoolingSink(
        "ch",
        inner,
        Spool.open(SpoolConfig(directory=tmp_path / "spool")),
        mode="outage",
        backoff=Backoff(initial=0.05, multiplier=2.0, maximum=0.5),
    )
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(sink.run)
            await sink.submit(vec_batch(0, 8))
            await sink.wait_delivered()
            await trio.to_thread.run_sync(facade.kill)
            await sink.submit(vec_batch(0, 8, seq_start=8))
            await sink.flush()  # no raise: the batch is durable in the spool
            assert sink.failure is None
            assert not sink.health.healthy
            reason = f"unreachable: ClickHouse server at {facade.url}: Connection refused"
            assert sink.health.reason == reason
            assert len(sink.spool) > 0
            await trio.to_thread.run_sync(facade.start)  # same data, same port
            await sink.wait_delivered()
            await sink.close()
    assert sink.health.healthy and sink.failure is None
    assert count(facade.url) == (16, 16)  # every record, once


async def test_a_plain_sink_names_the_server_it_could_not_reach_at_runtime(facade):
    sink = ClickHouseSink.server(
        SCHEMA,
        facade.url,
        raw=["vec"],
        create_tables=True,
        hooks=hooks_with_q(),
        retry=Retry(attempts=2, initial_backoff=0.01),
    )
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(sink.run)
            await sink.submit(vec_batch(0, 8))
            await sink.flush()
            await trio.to_thread.run_sync(facade.kill)
            await sink.submit(vec_batch(0, 8, seq_start=8))
            with pytest.raises(RoutingFailure) as caught:
                await sink.flush()
            nursery.cancel_scope.cancel()
    assert f"into ClickHouse server at {facade.url} after 2 attempt(s)" in str(caught.value)
    # The first try's driver error; the retry asked the server first (the
    # socket's refusal: transport.py, after an insert that found no server).
    assert isinstance(caught.value.cause, (OperationalError, ConnectionRefusedError))
    assert "Connection refused" in str(caught.value)
