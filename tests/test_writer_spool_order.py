"""A writer process sink under an ``"outage"`` spool: a block handed to the
spool is repeated before anything that started after it, so its repeat
finds its first try in the table's deduplication window.  Real processes,
real chDB, a window as small as the check allows (3, for inserts_in_flight
= 2).

A block whose insert landed but whose answer says it failed (a server's
answer lost after the insert was stored: the writer's insert timed out) is
the one repeated; the writer sink's message handler turns the first
``Done`` into such a ``Failed``.  Nothing here waits by sleeping."""

from __future__ import annotations

import trio

from taproute.routing import HookRegistry
from taproute.service.sinks.clickhouse import Batching
from taproute.service.sinks.spool import Spool, SpoolConfig
from taproute.service.sinks.spool.spooling import Backoff, SpoolingSink
from taproute.service.sinks.writer import WriterProcessSink
from taproute.service.sinks.writer.protocol import Done, Failed
from tests.test_writer_process import SCHEMA, step_batch
from tests.test_writer_repeats import window_of_three
from tests.test_writer_spool import GUARD_S

BLOCKS = 8


def first_answer_lost(writer: WriterProcessSink) -> list[int]:
    """The first block the writer persists is answered as failed (transient):
    its rows are in the table, and the spool repeats it.  Returns the list
    its id goes to."""
    lost: list[int] = []
    handle = writer._on_message

    def on_message(message: object) -> None:
        if isinstance(message, Done) and not lost:
            lost.append(message.block)
            message = Failed(
                message.block,
                TimeoutError("answer lost after the insert was stored (injected)"),
                transient=True,
            )
        handle(message)

    writer._on_message = on_message  # type: ignore[method-assign]
    return lost


async def test_blocks_sealed_after_one_handed_to_the_spool_follow_it_there(tmp_path, monkeypatch):
    """Eight blocks; the writer's first answer (for the first or second block)
    lost after its block landed, so that block goes to the spool under its
    token.  It counted as done there, and the blocks after it went on to the
    writer, six of them before the spool's repeat (here the repeat waits
    until the writer sink has nothing of its own left, as a drain busy with
    earlier groups or waiting out a backoff would): the repeat landed out of
    the window and wrote that step's rows again (36 rows for 32).  Now, as
    in-process, the blocks not sent yet follow it into the spool untried, in
    order, and every row is there once."""
    window_of_three(tmp_path)
    batching = Batching(max_rows=4, inserts_in_flight=2, linger=3600)
    writer = WriterProcessSink.embedded(SCHEMA, tmp_path / "data", raw=["acts"], batching=batching)
    hooks = HookRegistry()
    hook = hooks.bind("h.0", layout="acts")
    sink = SpoolingSink(
        "ch",
        writer,
        Spool.open(SpoolConfig(directory=tmp_path / "spool")),
        backoff=Backoff(initial=0.01, maximum=0.05),
    )
    sink.use_hooks(hooks)
    lost = first_answer_lost(writer)
    real_insert_now = writer.insert_now

    async def insert_now(batches, token):
        while writer._own_blocks():
            await writer._idle.park()
        await real_insert_now(batches, token)

    writer.insert_now = insert_now  # type: ignore[method-assign]
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        with trio.fail_after(GUARD_S):
            for step in range(1, BLOCKS + 1):
                await sink.submit(step_batch(hook, step))  # a block each (max_rows)
            await sink.wait_delivered()
            await sink.close()
    assert lost and sink.failure is None
    rows = writer.query(
        "SELECT step, count() AS n FROM raw_acts GROUP BY step ORDER BY step"
    ).to_pylist()
    assert rows == [{"step": s, "n": 4} for s in range(1, BLOCKS + 1)]
    c = sink.snapshot()
    assert c.accepted_records == c.delivered_records == 4 * BLOCKS


async def test_a_block_at_the_writer_when_batches_spill_is_repeated_before_them(tmp_path):
    """The first block landed and the writer's answer is held; the destination
    is behind (a small buffer), so the next six batches spill to the spool.
    The drain inserted them through the writer while the first block's
    outcome was unknown, and when its answer came (failed: the insert's
    answer lost) it went to the spool behind them: its repeat came 6 inserts
    after its first try, out of the window, and wrote step 1's rows again
    (32 rows for 28).  Now a spill first hands the writer sink's unfinished
    blocks to the spool, in order, and the spool's repeat of a block the
    writer has waits for the writer's answer for it: every row once."""
    from tests.test_writer_spool import wait_for

    window_of_three(tmp_path)
    step_bytes = step_batch(0, 1).nbytes
    batching = Batching(
        max_rows=4, inserts_in_flight=2, linger=3600, max_buffered_bytes=2 * step_bytes
    )
    writer = WriterProcessSink.embedded(SCHEMA, tmp_path / "data", raw=["acts"], batching=batching)
    hooks = HookRegistry()
    hook = hooks.bind("h.0", layout="acts")
    sink = SpoolingSink(
        "ch",
        writer,
        Spool.open(SpoolConfig(directory=tmp_path / "spool")),
        backoff=Backoff(initial=0.01, maximum=0.05),
        spill_at=0.5,
        group_bytes=1,  # a drain insert per spilled batch
    )
    sink.use_hooks(hooks)
    assert sink.spool is not None
    held: list[Done] = []
    handle = writer._on_message

    def on_message(message: object) -> None:
        if isinstance(message, Done) and not held:
            held.append(message)  # it landed; its answer waits for the test
            return
        handle(message)

    writer._on_message = on_message  # type: ignore[method-assign]
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        with trio.fail_after(GUARD_S):
            await sink.submit(step_batch(hook, 1))  # a block (max_rows), sent
            await wait_for(lambda: bool(held))
            for step in range(2, 8):
                await sink.submit(step_batch(hook, step))
            assert sink.snapshot().spilled_records == 24
            # Either the drain inserted the six spilled batches, or they wait in
            # the spool behind the first block, whose answer the writer owes.
            first = held[0].block
            await wait_for(
                lambda: (
                    writer.counters.blocks >= 6
                    or (first in writer._abandoned and len(sink.spool) == 7)
                )
            )
            handle(
                Failed(
                    first,
                    TimeoutError("answer lost after the insert was stored (injected)"),
                    transient=True,
                )
            )
            await sink.wait_delivered()
            await sink.close()
    assert sink.failure is None
    rows = writer.query(
        "SELECT step, count() AS n FROM raw_acts GROUP BY step ORDER BY step"
    ).to_pylist()
    assert rows == [{"step": s, "n": 4} for s in range(1, 8)]
    c = sink.snapshot()
    assert c.accepted_records == c.delivered_records == 28
