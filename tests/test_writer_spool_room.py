"""A writer process SIGKILLed with blocks in flight, under an ``"outage"``
spool that takes one frame at a time (``block`` until there is room, for
good): the blocks handed to the spool wait for room that only the drain
makes, and the drain's repeats (``insert_now``) go to the restarted writer
meanwhile.

A repeat that waited its turn behind the blocks still being handed over
(the writer sink's start order, ``TableOrder``) would wait for them, they
for room, the room for the repeat: nothing delivered, ``flush`` never
returning.  ``insert_now`` waits only for answers the writer owes (never
for room in the spool), so every row arrives once.  Real chDB in real
writer processes; the writer is stopped (SIGSTOP) so that the kill lands
while inserts are in flight; nothing waits by sleeping."""

from __future__ import annotations

import math
import os
import signal

import trio

from taproute.routing import HookRegistry
from taproute.service.sinks.clickhouse import Batching
from taproute.service.sinks.spool import Spool, SpoolConfig
from taproute.service.sinks.spool.spooling import Backoff, SpoolingSink
from taproute.service.sinks.writer import WriterProcessSink
from taproute.service.sinks.writer.blocks import HANDING
from tests.conftest import vec_batch
from tests.processors import SCHEMA
from tests.test_writer_spool import counts, guarded, in_flight, wait_for

BLOCKS = 6


async def test_a_full_spool_takes_a_killed_writers_blocks_while_the_drain_repeats_them(tmp_path):
    hooks = HookRegistry()
    hooks.bind("q", layout="vec")
    writer = WriterProcessSink.embedded(
        SCHEMA,
        tmp_path / "data",
        raw=["vec"],
        hooks=hooks,
        restarts=0,
        batching=Batching(max_rows=4),
    )
    spool = Spool.open(
        SpoolConfig(
            directory=tmp_path / "spool", quota_bytes=1, when_full="block", block_timeout=math.inf
        )
    )
    sink = SpoolingSink("ch", writer, spool, backoff=Backoff(initial=0.01, maximum=0.05))
    handing: list[int] = []  # blocks waiting to be handed over, seen at each drain insert
    real_insert_now = writer.insert_now

    async def insert_now(batches, token):
        handing.append(sum(b.state == HANDING for b in writer._blocks.values()))
        await real_insert_now(batches, token)

    writer.insert_now = insert_now  # type: ignore[method-assign]
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        first = writer.writer_pid
        assert first is not None
        os.kill(first, signal.SIGSTOP)
        try:
            for i in range(BLOCKS):  # a block each (max_rows), two sent, the rest in turn
                await sink.submit(vec_batch(0, 4, seq_start=4 * i))
            await wait_for(lambda: in_flight(writer, direct=False))
        finally:
            os.kill(first, signal.SIGKILL)
        with guarded(sink):
            await sink.flush()  # every block durable in the spool, one frame at a time
            await sink.wait_delivered()
            assert await counts(writer) == {"n": 4 * BLOCKS, "u": 4 * BLOCKS, "lo": 0, "hi": 23}
            await sink.close()
    assert writer.counters.crashes == 1 and writer.failure is None and sink.failure is None
    c = sink.snapshot()
    assert c.spool.appended_records == c.spool.acked_records == 4 * BLOCKS
    assert c.spool.blocked_seconds > 0  # hand-overs waited for room
    # The drain repeated blocks while others still waited to be handed over.
    assert max(handing) > 0
