"""close() of a ClickHouse sink waits at most ``close_timeout`` for the
inserts of its own batched path: a server that took an insert and went silent
held close for clickhouse-connect's read timeout (300 s).  Past the bound a
spooling destination takes the block into its spool, under its token; a plain
sink counts its rows as abandoned and close raises, naming table, rows and
server.  The producers' buffers go back only when the abandoned attempt's
thread returns (it reads them).

The silent server is a proxy in front of chfacade that takes the insert and
never answers (tests/clickhouse_backends.py, fault ``("hang",)``)."""

from __future__ import annotations

import threading
import time

import pytest
import trio

from taproute.routing import RoutingFailure
from taproute.service import ClickHouseSink, Spool, SpoolConfig, SpoolingSink
from taproute.service.sinks.clickhouse import InsertAbandoned
from taproute.service.sinks.spool.spooling import Backoff
from tests.clickhouse_backends import FaultyProxy
from tests.conftest import vec_batch
from tests.processors import SCHEMA
from tests.test_clickhouse_unreachable import GUARD_S, count, hooks_with_q
from tests.test_spool_close import spooled_records

#: Far below the 300 s read timeout a silent server held close for.
BOUND_S = 30.0


@pytest.fixture
def silent(facade):
    """A proxy whose first insert is taken and never answered."""
    proxy = FaultyProxy(facade.url, [("hang",)])
    yield proxy
    proxy.close()


def server_sink(url: str, **options) -> ClickHouseSink:
    return ClickHouseSink.server(
        SCHEMA, url, raw=["vec"], create_tables=True, hooks=hooks_with_q(), **options
    )


async def test_a_spooled_close_hands_a_silent_insert_to_the_spool(facade, silent, tmp_path):
    released = threading.Event()
    inner = server_sink(silent.url, close_timeout=1.0)
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
            batch = vec_batch(0, 8, release=released.set)
            await sink.submit(batch)
            batch.lease.release()  # the submitter's hold: the sink's is left
            started = time.monotonic()
            await sink.close()
            took = time.monotonic() - started
    assert 1.0 <= took < BOUND_S
    assert sink.failure is None
    assert inner.table_counters()["raw_vec"].abandoned_rows == 0  # kept: spooled
    assert await spooled_records(tmp_path / "spool") == 8
    assert not released.is_set()  # the silent attempt still reads the buffer
    silent.released.set()
    assert await trio.to_thread.run_sync(released.wait, GUARD_S)
    # The next start delivers them, once.
    again = SpoolingSink(
        "ch",
        server_sink(facade.url),
        Spool.open(SpoolConfig(directory=tmp_path / "spool")),
        mode="outage",
    )
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(again.run)
            await again.wait_delivered()
            await again.close()
    assert count(facade.url) == (8, 8)


async def test_a_plain_sink_reports_what_close_stopped_waiting_for(facade, silent):
    released = threading.Event()
    sink = server_sink(silent.url, close_timeout=1.0)
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(sink.run)
            batch = vec_batch(0, 8, release=released.set)
            await sink.submit(batch)
            batch.lease.release()  # the submitter's hold: the sink's is left
            started = time.monotonic()
            with pytest.raises(RoutingFailure) as caught:
                await sink.close()
            took = time.monotonic() - started
    assert 1.0 <= took < BOUND_S
    assert sink.table_counters()["raw_vec"].abandoned_rows == 8
    assert isinstance(caught.value.cause, InsertAbandoned)
    assert (
        "no answer within 1 s (close_timeout): stopped waiting for the insert of 8 rows "
        f"into table 'raw_vec' at ClickHouse server at {silent.url}; not known to be written"
    ) in str(caught.value)
    assert not released.is_set()
    silent.released.set()
    assert await trio.to_thread.run_sync(released.wait, GUARD_S)
    assert count(facade.url) == (0, 0)


async def test_a_cancelled_close_releases_the_transport_once_its_insert_returned(chdb_transport):
    """close() cancelled while it waited for an insert never started its last
    step, closing the transport: a caller cut off left the chDB session
    open for the life of the process (no other directory could be opened
    in it).  A cancelled close now still lets go of it: not under the
    insert it stopped waiting for (its rows land), but once that returned."""
    import uuid

    from taproute.routing import SinkClosed
    from taproute.service.sinks.clickhouse.transport import _SharedSession
    from tests.sinks import close_cancelled_while_inserting
    from tests.test_shutdown_grace import _embedded_clickhouse

    users = _SharedSession.users  # the fixture's transport on the same directory
    entered, release = threading.Event(), threading.Event()
    table = f"cancelled_close_{uuid.uuid4().hex[:8]}"
    sink = _embedded_clickhouse(chdb_transport, table, [], entered, release)()
    sink.use_hooks(hooks_with_q())
    try:
        with trio.fail_after(GUARD_S):
            async with trio.open_nursery() as nursery:
                await nursery.start(sink.run)
                assert await close_cancelled_while_inserting(sink, entered, GUARD_S)
        assert sink.calls_running == 1  # the insert, abandoned, still in its thread
        assert _SharedSession.users == users + 1  # not closed under it
        with pytest.raises(SinkClosed):
            sink.check_tables()  # later calls are refused
    finally:
        release.set()
    assert await trio.to_thread.run_sync(sink._calls.wait_released, GUARD_S)
    assert _SharedSession.users == users
    rows = chdb_transport.query(f"SELECT count() AS n FROM `{table}`").column("n")[0].as_py()
    assert rows == 8


def test_close_timeout_must_be_seconds(chdb_transport):
    for bad in (-1, float("nan"), float("inf"), "5"):
        with pytest.raises(ValueError, match="close_timeout must be seconds >= 0"):
            ClickHouseSink(
                chdb_transport, SCHEMA, raw=["vec"], close_timeout=bad, owns_transport=False
            )


def test_a_config_file_sets_close_timeout_and_refuses_a_negative_one(tmp_path):
    from taproute.service.host.config import ConfigFileError, load_config
    from tests.processors import LAYOUTS_TOML

    path = tmp_path / "router.toml"
    body = LAYOUTS_TOML + (
        '\n[[routes]]\nname = "raw"\noutputs = ["layers.*"]\ndestination = "ch"\n'
        '\n[destinations.ch]\nurl = "http://127.0.0.1:8123/default"\nraw = ["vec"]\n'
        'close_timeout = @S@\n\n[routing]\nunmatched = "drop"\n'
    )
    path.write_text(body.replace("@S@", "2.5"))
    assert load_config(path).destinations["ch"].close_timeout == 2.5
    path.write_text(body.replace("@S@", "-1"))
    with pytest.raises(ConfigFileError) as refused:
        load_config(path)
    assert "destinations.ch.close_timeout: must be in [0, 86400], found -1" in str(refused.value)


async def test_closing_a_routing_sink_is_bounded_by_its_owned_destinations_close_timeout(
    facade, silent
):
    """A destination the routing sink created (a factory) is flushed by its
    own close(), within its close_timeout: the routing sink's close does not
    first wait out the silent server with a plain flush."""
    from taproute.actors import open_routing_sink
    from taproute.routing import Route, RoutingConfig

    config = RoutingConfig([Route("raw", "*", "ch")])
    made: list[ClickHouseSink] = []

    def destination() -> ClickHouseSink:
        made.append(  # the routing sink gives it its hooks
            ClickHouseSink.server(
                SCHEMA, silent.url, raw=["vec"], create_tables=True, close_timeout=1.0
            )
        )
        return made[-1]

    started = 0.0
    with trio.fail_after(GUARD_S), pytest.raises(RoutingFailure, match="close_timeout"):
        async with open_routing_sink(config, SCHEMA, {"ch": destination}, unmatched="drop") as sink:
            sink.bind_hook("q", layout="vec")
            batch = vec_batch(0, 8)
            await sink.submit(batch)
            batch.lease.release()
            started = time.monotonic()
    assert time.monotonic() - started < BOUND_S
    assert made[0].table_counters()["raw_vec"].abandoned_rows == 8
