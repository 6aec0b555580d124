"""close() of a spooled ClickHouse destination that can't be reached returns
at once: it does not wait out the try its drain has in flight.

Such a try blocks in a worker thread for the transport's own timeouts
(connect_timeout, 10 s per connection try against a host that drops the
connection; a close measured ~20-33 s).  Here the transport holds the try
until the test releases it, and fails it as unreachable then; it is never
released before ``close()`` returns, so a close that waits for it waits
out ``HOLD_S`` and the test fails.  The spooled records stay on disk for
the next start, and the transport is closed only once the abandoned call
returned, never under it.
"""

from __future__ import annotations

import threading

import pytest
import trio

from taproute.routing import HookRegistry
from taproute.service import ClickHouseSink
from taproute.service.sinks.spool import Spool, SpoolConfig
from taproute.service.sinks.spool.spooling import Backoff, SpoolingSink
from tests.clickhouse_backends import Backend
from tests.conftest import vec_batch
from tests.processors import SCHEMA

#: How long a held call waits for the test before failing on its own (a
#: close that waits for it takes this long): a bound, not a synchronisation.
HOLD_S = 30.0
GUARD_S = 120.0


class HeldTransport:
    """The real chDB transport behind an unreachable server: the first
    ``fail`` calls of ``insert`` and ``describe`` fail at once (connection
    refused), later ones are held (as one waiting for a connect timeout)
    until :attr:`release`, then fail too.  Counts the calls running when it
    is closed (it never closes the shared chDB session)."""

    def __init__(self, inner, *, fail: int) -> None:
        self.inner = inner
        self.description = inner.description
        self.down = True
        self._fail = fail
        self._lock = threading.Lock()
        self.entered = threading.Event()
        self.release = threading.Event()
        self.closed = threading.Event()
        self.running = 0
        self.running_at_close: int | None = None
        self.held_out = False  # a held call waited HOLD_S for the test

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _unreachable(self) -> None:
        with self._lock:
            if not self.down:
                return
            self._fail -= 1
            hold = self._fail < 0
            self.running += hold
        if hold:
            try:
                self.entered.set()
                self.held_out = not self.release.wait(HOLD_S)
            finally:
                with self._lock:
                    self.running -= 1
        raise ConnectionRefusedError("destination unreachable (injected)")

    def insert(self, table, data, *, dedup_token, settings=None):
        self._unreachable()
        self.inner.insert(table, data, dedup_token=dedup_token, settings=settings)

    def describe(self, table):
        self._unreachable()
        return self.inner.describe(table)

    def is_transient(self, error):
        return self.inner.is_transient(error)

    def close(self) -> None:
        with self._lock:
            self.running_at_close = self.running
        self.closed.set()


@pytest.fixture
def backend(chdb_transport):
    return Backend("chdb", chdb_transport)


def spooled(backend, directory, transport, **kwargs) -> SpoolingSink:
    hooks = HookRegistry()
    hooks.bind("q", layout="vec")
    inner = ClickHouseSink(
        transport,
        SCHEMA,
        raw=["vec"],
        raw_table=f"{backend.prefix}_raw_{{layout}}",
        create_tables=True,
        hooks=hooks,
        owns_transport=True,
        **kwargs,
    )
    return SpoolingSink(
        "ch",
        inner,
        Spool.open(SpoolConfig(directory=directory)),
        backoff=Backoff(initial=0.01, maximum=0.01),
    )


async def run_sink(sink: SpoolingSink, stopped: trio.Event, *, task_status) -> None:
    """``sink.run``, then ``stopped`` set: what hosts the sink waits for."""
    try:
        await sink.run(task_status=task_status)
    finally:
        stopped.set()


async def close_while_held(sink: SpoolingSink, transport: HeldTransport, stopped) -> None:
    """Wait for the drain's try to be held, close (and the sink's task end),
    then let the try end."""
    await trio.to_thread.run_sync(transport.entered.wait, GUARD_S)
    assert transport.entered.is_set()
    await sink.close()
    await stopped.wait()  # a runtime's close waits for this too
    assert not transport.held_out, "close() waited for the try in flight"
    assert not transport.closed.is_set()  # not under the running call
    transport.release.set()
    await trio.to_thread.run_sync(transport.closed.wait, GUARD_S)
    assert transport.running_at_close == 0  # by the abandoned call, once it returned


async def spooled_records(directory) -> int:
    """The records a next start finds in the spool at ``directory``."""
    spool = Spool.open(SpoolConfig(directory=directory))
    try:
        return (await spool.read_group(1 << 30)).records if len(spool) else 0
    finally:
        await spool.aclose()


async def test_close_abandons_the_drains_insert_to_an_unreachable_server(backend, tmp_path):
    """The server went away: the sink's block failed and was spooled; the
    drain's insert of it is held.  close() returns, the records spooled."""
    backend.sink(SCHEMA, raw=["vec"])  # the table exists: no check pending
    transport = HeldTransport(backend.transport, fail=0)
    transport.down = False
    sink = spooled(backend, tmp_path / "spool", transport)
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(run_sink, sink, stopped := trio.Event())
            transport.down = True
            transport._fail = 1  # the sink's own insert fails; the drain's is held
            await sink.submit(vec_batch(0, 8))
            await sink.flush()  # durable in the spool
            assert not sink.health.healthy
            await close_while_held(sink, transport, stopped)
    assert await spooled_records(tmp_path / "spool") == 8


async def test_close_abandons_the_table_check_of_a_server_down_since_the_start(backend, tmp_path):
    """Built while the server was down (tables unchecked): the drain's table
    check is held.  close() returns, the records spooled."""
    transport = HeldTransport(backend.transport, fail=1)  # the check at construction
    sink = spooled(backend, tmp_path / "spool", transport, when_unreachable="check_later")
    assert not sink.health.healthy
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(run_sink, sink, stopped := trio.Event())
            await sink.submit(vec_batch(0, 8))
            await sink.flush()
            await close_while_held(sink, transport, stopped)
    assert await spooled_records(tmp_path / "spool") == 8
