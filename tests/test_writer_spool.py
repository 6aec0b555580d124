"""A spool in front of a writer process (``SpoolingSink`` around
``WriterProcessSink``): spooled batches drain into the writer under their
tokens, and a writer SIGKILLed while it inserts loses nothing and writes
nothing twice.  Real chDB in real writer processes; the writer is stopped
(SIGSTOP) so that the kill lands while an insert is in flight, whatever the
machine's speed."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterator

import pytest
import trio

from taproute.routing import HookRegistry
from taproute.service.sinks.clickhouse import Batching
from taproute.service.sinks.spool import Spool, SpoolConfig
from taproute.service.sinks.spool.spooling import Backoff, SpoolingSink
from taproute.service.sinks.writer import WriterProcessSink
from taproute.service.sinks.writer.blocks import SENT
from tests.conftest import vec_batch
from tests.processors import SCHEMA

#: A hang guard only: a restart starts a new interpreter and chDB, which on a
#: loaded 2-core machine takes far longer than on a quiet one.  Two of them in
#: a row stay under pytest's --timeout (300 s), so a hang fails here, saying
#: where the writer and the spool stood, instead of as a bare timeout.
GUARD_S = 120


async def wait_for(condition: Callable[[], bool]) -> None:
    """Wait until ``condition()`` holds (checked every 10 ms; GUARD_S is a hang guard)."""
    with trio.fail_after(GUARD_S):
        while not condition():
            await trio.sleep(0.01)


@contextlib.contextmanager
def guarded(sink: SpoolingSink) -> Iterator[None]:
    """Fail after GUARD_S seconds, printing where the writer and the spool stood."""
    writer = sink.inner
    assert isinstance(writer, WriterProcessSink)
    try:
        with trio.fail_after(GUARD_S):
            yield
    except trio.TooSlowError:
        blocks = [(b.id, b.state, b.waiter, b.rows) for b in writer._blocks.values()]
        print("writer", writer.counters, writer.health, writer.failure, blocks)
        print("unsent", list(writer._unsent), "queries", list(writer._queries))
        print("spool", len(sink.spool), sink.snapshot(), sink.health, sink.failure)
        raise


def in_flight(writer: WriterProcessSink, *, direct: bool) -> bool:
    """True while a block (an ``insert_now``'s when ``direct``) is at the writer."""
    return any(
        block.state == SENT and (block.waiter is not None) == direct
        for block in writer._blocks.values()
    )


def spooled_writer(tmp_path, mode: str, **writer_options) -> SpoolingSink:
    hooks = HookRegistry()
    hooks.bind("q", layout="vec")
    writer = WriterProcessSink.embedded(
        SCHEMA, tmp_path / "data", raw=["vec"], hooks=hooks, **writer_options
    )
    return SpoolingSink(
        "ch",
        writer,
        Spool.open(SpoolConfig(directory=tmp_path / "spool")),
        mode=mode,  # type: ignore[arg-type]
        backoff=Backoff(initial=0.01, maximum=0.05),
    )


async def counts(writer: WriterProcessSink) -> dict[str, int]:
    table = await writer.aquery(
        "SELECT count() AS n, uniqExact(seq) AS u, min(seq) AS lo, max(seq) AS hi FROM raw_vec"
    )
    return {k: int(v) for k, v in table.to_pylist()[0].items()}


async def test_always_spool_drains_into_a_writer_sigkilled_mid_insert(tmp_path):
    # restarts=0: alone, one death would latch; under a spool the writer is
    # restarted however often it dies (the spool holds the batches).
    sink = spooled_writer(tmp_path, "always", restarts=0)
    writer = sink.inner
    assert isinstance(writer, WriterProcessSink)
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        first = writer.writer_pid
        assert first is not None
        os.kill(first, signal.SIGSTOP)
        try:
            for i in range(6):
                await sink.submit(vec_batch(0, 4, seq_start=4 * i))
            await sink.flush()  # durable in the spool; the writer can't insert
            await wait_for(lambda: in_flight(writer, direct=True))  # a drain insert is out
        finally:
            os.kill(first, signal.SIGKILL)
        with guarded(sink):
            await sink.wait_delivered()
            assert await counts(writer) == {"n": 24, "u": 24, "lo": 0, "hi": 23}
            assert writer.counters.crashes == 1 and writer.counters.restarts == 1
            assert writer.writer_pid not in (None, first)
            assert writer.failure is None and sink.failure is None
            assert sink.counters.retries >= 1  # the insert cut short was tried again
            snapshot = sink.snapshot()
            assert snapshot.spool.acked_records == 24 and snapshot.spool.frames == 0
            # A replay under the same token (a crash after the insert, before the
            # spool's ack) writes nothing twice.
            again = vec_batch(0, 4, seq_start=100)
            await writer.insert_now([again], "replayed-token")
            await writer.insert_now([vec_batch(0, 4, seq_start=100)], "replayed-token")
            assert (await counts(writer))["n"] == 28
            await sink.close()


async def test_outage_spool_takes_over_blocks_of_a_writer_sigkilled_mid_insert(tmp_path):
    # One block per batch (max_rows=4), sent to a stopped writer, then killed:
    # the unfinished blocks are handed to the spool under their tokens.
    sink = spooled_writer(tmp_path, "outage", restarts=0, batching=Batching(max_rows=4))
    writer = sink.inner
    assert isinstance(writer, WriterProcessSink)
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        await sink.submit(vec_batch(0, 4, seq_start=0))
        await sink.flush()  # persisted by the healthy writer: the batched path
        assert sink.counters.delivered_records == 4
        assert sink.snapshot().spool.appended_records == 0
        first = writer.writer_pid
        assert first is not None
        os.kill(first, signal.SIGSTOP)
        try:
            for i in range(1, 6):
                await sink.submit(vec_batch(0, 4, seq_start=4 * i))
            await wait_for(lambda: in_flight(writer, direct=False))
        finally:
            os.kill(first, signal.SIGKILL)
        with guarded(sink):
            await sink.wait_delivered()
            assert await counts(writer) == {"n": 24, "u": 24, "lo": 0, "hi": 23}
            assert writer.counters.crashes == 1 and writer.failure is None
            snapshot = sink.snapshot()
            assert snapshot.spool.appended_records > 0  # handed over, then drained
            assert snapshot.spool.acked_records == snapshot.spool.appended_records
            assert sink.counters.delivered_records == 24
            assert sink.health.healthy
            await sink.close()
    assert writer.writer_pid is None


@pytest.mark.parametrize("mode", ["outage", "always"])
async def test_a_query_asked_while_the_writer_restarts_is_answered(tmp_path, mode):
    sink = spooled_writer(tmp_path, mode)
    writer = sink.inner
    assert isinstance(writer, WriterProcessSink)
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        await sink.submit(vec_batch(0, 4))
        await sink.wait_delivered()
        first = writer.writer_pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        await wait_for(lambda: writer.counters.crashes == 1)  # restarting now
        with guarded(sink):
            assert (await counts(writer))["n"] == 4
            await sink.close()


def starting_writers(known: set[int]) -> list[int]:
    """Writer processes this process started that are not in ``known``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in known:
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                command = cmdline.read()
        except OSError:
            continue
        if parent == os.getpid() and b"taproute.service.sinks.writer.child" in command:
            found.append(int(entry))
    return found


async def test_a_writer_killed_while_it_restarts_is_restarted_again(tmp_path):
    """A replacement writer SIGKILLed before it was ready (an OOM killer in a
    crash loop) latched the destination as a writer that "cannot be started"
    (``did not answer within 120.0 s: Connection reset by peer``, at once),
    though under a spool a dying writer is restarted however often it dies.
    It is a death like the first: counted, and restarted."""
    sink = spooled_writer(tmp_path, "outage", restarts=0)
    writer = sink.inner
    assert isinstance(writer, WriterProcessSink)
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        await sink.submit(vec_batch(0, 4, seq_start=0))
        await sink.flush()
        first = writer.writer_pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        with guarded(sink):
            while not (replacement := starting_writers({first})):
                await trio.sleep(0.001)
        # Stopped at once: a new interpreter importing chDB is far from ready.
        (starting,) = replacement
        os.kill(starting, signal.SIGSTOP)
        assert writer.writer_pid == first  # still the dead one: not started yet
        os.kill(starting, signal.SIGKILL)
        for i in range(1, 6):
            await sink.submit(vec_batch(0, 4, seq_start=4 * i))
        with guarded(sink):
            await sink.wait_delivered()
            assert writer.failure is None and sink.failure is None
            assert writer.counters.crashes == 2 and writer.counters.restarts == 1
            assert writer.writer_pid not in (None, first, starting)
            assert await counts(writer) == {"n": 24, "u": 24, "lo": 0, "hi": 23}
            await sink.close()
