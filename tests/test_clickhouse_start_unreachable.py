"""A spooled ClickHouse server destination starts while its server is down:
batches spool, the destination is reported unhealthy, and its tables are
checked when the server is first reached, before anything is written; a
table that doesn't fit then latches a failure naming table, column,
expected and found, and the spooled records stay on disk for a start with
the table fixed.

The server (chfacade in a child process) is started, to fix its port and
data, and killed before the destination is built; it is started again, on
the same data and port, after the destination runs.  Without a spool (or
built with the default ``when_unreachable``) an unreachable server still
refuses the start (tests/test_clickhouse_unreachable.py)."""

from __future__ import annotations

import re

import pytest
import trio

from taproute.routing import RoutingFailure
from taproute.service import ClickHouseSink, Spool, SpoolConfig, SpoolingSink
from taproute.service.host.config import ConfigFileError, load_config
from taproute.service.sinks.clickhouse import ServerTransport
from taproute.service.sinks.clickhouse.tables import raw_table_spec
from taproute.service.sinks.spool.spooling import Backoff
from tests import chfacade
from tests.conftest import vec_batch
from tests.processors import LAYOUTS_TOML, SCHEMA
from tests.test_clickhouse_unreachable import GUARD_S, count, hooks_with_q


@pytest.fixture
def stopped_facade(tmp_path):
    """A chfacade server that ran once (its port and data fixed) and is down now."""
    chfacade.require()
    server = chfacade.Facade(tmp_path / "facade-data")
    server.start()
    server.kill()
    yield server
    server.kill()


def spooled(url: str, directory, **options) -> SpoolingSink:
    inner = ClickHouseSink.server(
        SCHEMA,
        url,
        raw=["vec"],
        create_tables=True,
        hooks=hooks_with_q(),
        when_unreachable="check_later",
        **options,
    )
    return SpoolingSink(
        "ch",
        inner,
        Spool.open(SpoolConfig(directory=directory)),
        mode="outage",
        backoff=Backoff(initial=0.05, multiplier=2.0, maximum=0.5),
    )


async def test_built_while_the_server_is_down_it_spools_then_checks_and_delivers_once(
    stopped_facade, tmp_path
):
    facade = stopped_facade
    sink = spooled(facade.url, tmp_path / "spool")
    assert not sink.inner.tables_checked
    assert not sink.health.healthy
    assert sink.health.reason == (
        f"unreachable: ClickHouse server at {facade.url}: Connection refused "
        "(tables not checked yet)"
    )
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(sink.run)
            await sink.submit(vec_batch(0, 8))
            await sink.flush()  # no raise: durable in the spool
            assert sink.failure is None and len(sink.spool) > 0
            assert not sink.health.healthy
            await trio.to_thread.run_sync(facade.start)  # same data, same port
            await sink.wait_delivered()
            assert sink.inner.tables_checked and sink.health.healthy
            await sink.submit(vec_batch(0, 8, seq_start=8))  # the direct path now
            await sink.wait_delivered()
            await sink.close()
    assert sink.failure is None
    assert count(facade.url) == (16, 16)  # every record, once


async def test_while_its_tables_wait_for_the_server_the_reason_says_so(stopped_facade, tmp_path):
    """The README quotes the unhealthy reason of a destination started while
    its server is down: ``unreachable: ClickHouse server at URL: reason
    (tables not checked yet)``. That held only until the drain's first try:
    each failed try to reach the server replaced it with the bare
    ``unreachable: ... Connection refused``, though the tables were still
    unchecked (seen on /healthz of a ``taproute run`` against a closed
    port)."""
    facade = stopped_facade
    sink = spooled(facade.url, tmp_path / "spool")
    expected = (
        f"unreachable: ClickHouse server at {facade.url}: Connection refused "
        "(tables not checked yet)"
    )
    assert sink.health.reason == expected and sink.health.consecutive_failures == 1
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(sink.run)
            await sink.submit(vec_batch(0, 8))
            await sink.flush()
            while sink.health.consecutive_failures < 3:  # the drain tried, twice
                await trio.sleep(0.01)
            assert not sink.inner.tables_checked
            assert sink.health.reason == expected
            await sink.close()


def _break_raw_vec(facade: chfacade.Facade) -> None:
    """Create ``raw_vec`` with ``seq`` as Int32 (the schema says Int64)."""
    facade.start()
    transport = ServerTransport(facade.url)
    try:
        sql = raw_table_spec(SCHEMA.layout("vec"), "raw_vec").create_sql()
        transport.execute(sql.replace("`seq` Int64", "`seq` Int32"))
    finally:
        transport.close()
    facade.kill()


async def test_a_table_that_does_not_fit_when_reached_latches_and_keeps_the_spool(
    stopped_facade, tmp_path
):
    facade = stopped_facade
    await trio.to_thread.run_sync(_break_raw_vec, facade)
    sink = spooled(facade.url, tmp_path / "spool")
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(sink.run)
            await sink.submit(vec_batch(0, 8))
            await sink.flush()
            await trio.to_thread.run_sync(facade.start)
            with pytest.raises(RoutingFailure) as caught:
                await sink.wait_delivered()
            with pytest.raises(RoutingFailure):
                await sink.submit(vec_batch(0, 8, seq_start=8))  # refused, not spooled
            with pytest.raises(RoutingFailure):
                await sink.close()
    message = str(caught.value)
    assert "destination 'ch'" in message
    assert "table 'raw_vec': column 'seq' expected Int64, found Int32" in message
    assert count(facade.url) == (0, 0)  # nothing written into the unchecked table
    assert sink.counters.refused_records == 0  # not dead-lettered: the table's fault

    # The records stayed in the spool: with the table fixed, the next start
    # delivers them, once.
    transport = ServerTransport(facade.url)
    try:
        transport.execute("DROP TABLE raw_vec")
    finally:
        transport.close()
    again = spooled(facade.url, tmp_path / "spool")
    assert again.inner.tables_checked  # reached at once: checked (and created) at start
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(again.run)
            await again.wait_delivered()
            await again.close()
    assert again.failure is None
    assert count(facade.url) == (8, 8)


CONFIG = (
    """
processors = ["tests.processors"]

"""
    + LAYOUTS_TOML
    + """
[[routes]]
name = "raw"
outputs = ["layers.*"]
destination = "ch"

[destinations.ch]
url = "@URL@"
raw = ["vec"]
create_tables = true
spool_dir = "@SPOOL@"

[routing]
unmatched = "drop"
"""
)


def test_a_configured_service_starts_degraded_and_check_still_refuses(stopped_facade, tmp_path):
    facade = stopped_facade
    path = tmp_path / "router.toml"
    path.write_text(CONFIG.replace("@URL@", facade.url).replace("@SPOOL@", str(tmp_path / "spool")))
    config = load_config(path)
    with pytest.raises(ConfigFileError) as refused:  # `taproute check` checks tables now
        config.check_destinations()
    assert f"destinations.ch.url: cannot open {facade.url}: Connection refused" in str(
        refused.value
    )
    with config.build() as built, built.start() as service:
        q = service.bind_hook("layers.0", layout="vec")
        batch = vec_batch(q, 8)
        service.submit_batch(batch.descriptors, batch.payload)
        service.flush(timeout=GUARD_S)
        destination = service.snapshot().destinations["ch"]
        assert destination.healthy == 0
        assert re.match(
            rf"unreachable: ClickHouse server at {re.escape(facade.url)}: Connection refused",
            destination.unhealthy_reason or "",
        )
        facade.start()
        service.flush(wait=True, timeout=GUARD_S)
        assert service.snapshot().destinations["ch"].healthy == 1
    assert count(facade.url) == (8, 8)
