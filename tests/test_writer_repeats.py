"""A block the writer sink re-sends (its reply lost, the writer killed)
finds its first try still in the table's deduplication window: real
processes, real chDB, a window as small as the check allows.

Nothing here waits by sleeping: the writer is killed once the model
process is quiet (``wait_all_tasks_blocked``) and every insert it sent,
the lost one aside, is answered."""

from __future__ import annotations

import os
import signal

import trio
import trio.testing

from taproute.routing import HookRegistry
from taproute.service.sinks.clickhouse import Batching
from taproute.service.sinks.writer import WriterProcessSink
from taproute.service.sinks.writer.protocol import Done, Insert
from tests.test_writer_process import SCHEMA, step_batch

BLOCKS = 6


def window_of_three(tmp_path) -> None:
    """The writer's raw table (in ``tmp_path / "data"``) remembers its last 3
    blocks: what ``inserts_in_flight = 2`` needs (a repeat and the 2 x 2 - 1
    inserts that may land around it)."""
    setup = WriterProcessSink.embedded(SCHEMA, tmp_path / "data", raw=["acts"])
    try:
        setup.query("ALTER TABLE raw_acts MODIFY SETTING non_replicated_deduplication_window = 3")
    finally:
        setup.close_unstarted()


def record_sent_blocks(monkeypatch) -> list[int]:
    """The list every ``Insert`` the parent sends to a writer appends its block id to."""
    from taproute.service.sinks.writer import protocol

    sent: list[int] = []
    real_send = protocol.MessageStream.send

    async def send(self, message: object) -> None:
        if isinstance(message, Insert):
            sent.append(message.block)
        await real_send(self, message)

    monkeypatch.setattr(protocol.MessageStream, "send", send)
    return sent


async def test_a_block_resent_after_its_lost_reply_and_a_writer_death_is_written_once(
    tmp_path, monkeypatch
):
    """With inserts_in_flight = 2 the writer's table window must hold 3
    inserts (a repeat and the 2 x 2 - 1 that may land around it), and 3 is
    what it holds here.  The first block's reply is lost after it landed,
    then the writer is SIGKILLed and the restarted one gets the block again
    under its token.  The parent used to send every sealed block at once, so
    the other five landed behind the lost one and its repeat came 6 inserts
    later, out of the window: its 4 rows twice (28 rows for 24).  Now the
    parent starts blocks in the table order (TableOrder): at most 3 inserts,
    the lost one included, land before its repeat (2 when the lost reply is
    the first block's, 3 when it is the second's and the first one's came),
    and every row is there once."""
    window_of_three(tmp_path)
    sent = record_sent_blocks(monkeypatch)
    batching = Batching(max_rows=4, inserts_in_flight=2, linger=3600)
    sink = WriterProcessSink.embedded(SCHEMA, tmp_path / "data", raw=["acts"], batching=batching)
    hooks = HookRegistry()
    hook = hooks.bind("h.0", layout="acts")
    sink.use_hooks(hooks)
    lost: list[int] = []
    answered = trio.lowlevel.ParkingLot()
    handle = sink._on_message

    def on_message(message: object) -> None:
        if isinstance(message, Done) and not lost:
            lost.append(message.block)  # it landed; its answer never arrives
        else:
            handle(message)
        answered.unpark_all()

    sink._on_message = on_message  # type: ignore[method-assign]
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        with trio.fail_after(120):
            for step in range(1, BLOCKS + 1):
                await sink.submit(step_batch(hook, step))  # a block each (max_rows)
            while True:
                await trio.testing.wait_all_tasks_blocked()
                # Quiet, and every insert sent is answered but the lost one's:
                # nothing more lands before the writer dies.
                if lost and len(sent) == 1 + sink.counters.blocks:
                    break
                await answered.park()
            landed = len(sent)  # the lost one and what landed around it
            pid = sink.writer_pid
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            await sink.flush()  # the restarted writer gets the lost block again
        assert sink.counters.crashes == 1 and sink.counters.restarts == 1
        await sink.close()
    rows = sink.query(
        "SELECT step, count() AS n FROM raw_acts GROUP BY step ORDER BY step"
    ).to_pylist()
    assert rows == [{"step": s, "n": 4} for s in range(1, BLOCKS + 1)]
    # 2 x inserts_in_flight - 1 at most (the window holds them all), not every
    # block sealed.
    assert landed <= 3
