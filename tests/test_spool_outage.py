"""A spooling destination through outages: nothing acknowledged lost, nothing twice.

The ClickHouse sink writes to real chDB through a transport that injects
faults on a schedule of MockClock time: unreachable windows (the insert
never happens), lost replies (the insert happens, then the call fails),
refusals of bad data (a non-transient ClickHouse code).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import trio
import trio.testing

from taproute.actors import open_routing_sink
from taproute.routing import HookRegistry, RoutingConfig
from taproute.routing.routes import Route
from taproute.service.sinks.spool import Spool, SpoolConfig
from taproute.service.sinks.spool.spooling import Backoff, SpoolingSink
from tests.clickhouse_backends import Backend
from tests.conftest import vec_batch
from tests.processors import SCHEMA
from tests.thread_aware_clock import thread_aware_clock


class Refused(Exception):
    """What chDB raises for a block of bad data."""


class FaultyTransport:
    """The real transport with faults: unreachable while ``down`` (the insert
    never happens), a lost reply every ``lose_every``-th stored insert,
    refusal of any block holding a seq in ``refuse``.

    The test flips ``down`` at points of MockClock time: chDB runs in worker
    threads, during which the mock clock may jump, so a fault schedule by
    clock reading inside the thread would not be deterministic.
    """

    def __init__(self, inner, *, lose_every=0, refuse=()):
        self.inner = inner
        self.description = inner.description
        self.down = False
        self.lose_every = lose_every
        self.refuse = set(refuse)
        self.inserts = 0
        self.lost = 0
        self.unreachable = 0
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def insert(self, table, data, *, dedup_token, settings=None):
        with self._lock:
            if self.down:
                self.unreachable += 1
                raise ConnectionRefusedError("destination unreachable (injected)")
            if self.refuse & set(data.column("seq").to_pylist()):
                raise Refused("Code: 53. DB::Exception: TYPE_MISMATCH (injected)")
        self.inner.insert(table, data, dedup_token=dedup_token, settings=settings)
        with self._lock:
            self.inserts += 1
            if self.lose_every and self.inserts % self.lose_every == 0:
                self.lost += 1
                raise TimeoutError("reply lost after the insert was stored (injected)")

    def is_transient(self, error):
        return self.inner.is_transient(error)


@pytest.fixture
def clock():
    """An autojump MockClock that never jumps while a worker thread runs (chDB
    inserts do): mock time passes only while the sink waits on it, so an
    outage's retries and health times do not depend on how fast the machine
    runs each insert (a 20 ms real-idleness threshold did: under load a slow
    failing insert let the clock skip past retries and health times)."""
    with thread_aware_clock() as clock:
        yield clock


@pytest.fixture
def backend(chdb_transport):
    return Backend("chdb", chdb_transport)


async def make_sink(backend, tmp_path, faults, *, mode="outage", hooks=None, dead=None, **spool):
    hooks = hooks or HookRegistry()
    hooks.bind("q", layout="vec") if "q" not in hooks.names() else None
    inner = backend.sink(SCHEMA, transport=faults, raw=["vec"], hooks=hooks)
    clock = trio.current_time

    async def dead_letter(batch, reason):
        dead.append((batch, reason))

    return SpoolingSink(
        "ch",
        inner,
        Spool.open(SpoolConfig(directory=tmp_path / "spool", **spool), clock=clock),
        mode=mode,
        backoff=Backoff(initial=0.5, multiplier=2.0, maximum=30.0),
        dead_letter=dead_letter if dead is not None else None,
        clock=clock,
    )


def stored(backend) -> tuple[int, int]:
    row = backend.query("SELECT count() AS n, uniqExact(seq) AS u FROM {p}_raw_vec").to_pylist()
    return int(row[0]["n"]), int(row[0]["u"])


async def produce(sink, transport, *, batches, size, every, first_seq=0):
    for i in range(batches):
        await sink.submit(vec_batch(0, size, seq_start=first_seq + i * size))
        await trio.sleep(every)


@pytest.mark.parametrize("mode", ["outage", "always"])
@pytest.mark.parametrize("outage_s", [60, 3600])
async def test_an_outage_of_any_length_loses_nothing_and_duplicates_nothing(
    backend, tmp_path, clock, mode, outage_s
):
    # Every 2nd stored insert loses its reply: at least one insert lands before
    # the outage and one after it, however the batched path groups batches
    # (under load it groups more), so a lost reply is always exercised.
    faults = FaultyTransport(backend.transport, lose_every=2)
    sink = await make_sink(backend, tmp_path, faults, mode=mode)
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        await produce(sink, faults, batches=10, size=8, every=1.0)
        await sink.wait_delivered()
        faults.down = True
        went_down = trio.current_time()
        await produce(sink, faults, batches=20, size=8, every=outage_s / 20, first_seq=80)
        await trio.sleep(outage_s)
        await sink.flush()  # returns during the outage: what is not delivered is durable
        health = sink.health
        assert not health.healthy and "unreachable" in (health.reason or "")
        assert went_down <= health.since <= went_down + outage_s / 20 + 1
        assert sink.failure is None
        assert len(sink.spool) > 0
        faults.down = False
        await produce(sink, faults, batches=10, size=8, every=1.0, first_seq=240)
        await sink.wait_delivered()
        await sink.close()
    assert sink.health.healthy and sink.failure is None
    assert faults.unreachable > 0 and faults.lost > 0
    # Retries went on all through the outage, never more than 30 s apart.
    assert sink.snapshot().retries >= outage_s / 30
    assert stored(backend) == (320, 320)  # every record, exactly once
    counters = sink.snapshot()
    assert counters.accepted_records == counters.delivered_records == 320
    assert counters.spool.frames == 0


async def test_flapping_with_lost_replies_and_a_refused_batch_accounts_exactly(
    backend, tmp_path, clock
):
    faults = FaultyTransport(backend.transport, lose_every=3, refuse={83})
    dead: list = []
    sink = await make_sink(backend, tmp_path, faults, dead=dead)

    async def flap():
        for _ in range(20):  # down 4 s of every 9
            await trio.sleep(5.0)
            faults.down = True
            await trio.sleep(4.0)
            faults.down = False

    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        nursery.start_soon(flap)
        await produce(sink, faults, batches=60, size=5, every=2.5)
        await sink.wait_delivered()
        await sink.close()
    assert sink.failure is None
    # seq 83 is in a group the destination refuses: the group is split until
    # only record 83 is left; that one is dead-lettered, the rest delivered.
    ((batch, reason),) = dead
    assert list(batch.descriptors["seq"]) == [83]
    assert "TYPE_MISMATCH" in reason and "'ch'" in reason
    n, unique = stored(backend)
    assert (n, unique) == (299, 299)
    c = sink.snapshot()
    assert c.refused_records == 1
    assert c.accepted_records == 300 == c.delivered_records + c.refused_records
    assert c.retries > 0 and faults.lost > 0


async def test_quota_drop_newest_during_an_outage_is_counted_in_the_books(backend, tmp_path, clock):
    faults = FaultyTransport(backend.transport)
    faults.down = True
    sink = await make_sink(backend, tmp_path, faults, quota_bytes=2000, when_full="drop_newest")
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        await produce(sink, faults, batches=30, size=4, every=1.0)
        faults.down = False
        await sink.wait_delivered()
        await sink.close()
    c = sink.snapshot()
    assert c.spool.dropped_records > 0
    assert c.accepted_records == 120 == c.delivered_records + c.spool.dropped_records
    assert stored(backend) == (c.delivered_records, c.delivered_records)


async def test_one_dead_destination_never_latches_the_router_nor_stalls_the_other(
    backend, tmp_path, clock
):
    hooks = HookRegistry()
    q = hooks.bind("q", layout="vec")
    dead_faults = FaultyTransport(backend.transport)
    dead_faults.down = True
    other = Backend("chdb", backend.transport)
    live = other.sink(SCHEMA, raw=["vec"], hooks=hooks)
    stuck = await make_sink(backend, tmp_path, dead_faults, hooks=hooks)
    config = RoutingConfig([Route("to_dead", ["q"], "dead"), Route("to_live", ["q"], "live")])
    async with open_routing_sink(
        config, SCHEMA, {"dead": lambda: stuck, "live": lambda: live}, hooks=hooks, unmatched="drop"
    ) as router:
        for i in range(50):
            await router.submit(vec_batch(q, 10, seq_start=i * 10))
            await trio.sleep(10.0)  # over 8 minutes of outage in all
        await router.flush()  # returns: the dead destination's batches are durable
        assert stored(other) == (500, 500)  # the live one got everything
        assert not stuck.health.healthy
        assert stuck.snapshot().spool.frames > 0
        assert router.failure is None
    assert stored(backend) == (0, 0)
    # The next start drains what the dead destination still holds.
    again = await make_sink(backend, tmp_path, FaultyTransport(backend.transport), hooks=hooks)
    assert len(again.spool) == 50
    async with trio.open_nursery() as nursery:
        await nursery.start(again.run)
        await again.wait_delivered()
        await again.close()
    assert stored(backend) == (500, 500)
    np.testing.assert_equal(
        backend.query("SELECT min(seq) AS a, max(seq) AS b FROM {p}_raw_vec").to_pylist(),
        [{"a": 0, "b": 499}],
    )


async def test_healthy_outage_mode_groups_batches_that_queue_behind_an_insert(
    backend, tmp_path, clock
):
    faults = FaultyTransport(backend.transport)
    sink = await make_sink(backend, tmp_path, faults)
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        for i in range(50):
            await sink.submit(vec_batch(0, 4, seq_start=i * 4))
        await sink.wait_delivered()
        await sink.close()
    assert stored(backend) == (200, 200)
    assert faults.inserts < 50  # batches that waited went in together
    assert sink.snapshot().spool.appended_batches == 0  # never touched the disk
