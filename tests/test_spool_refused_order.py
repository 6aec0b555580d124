"""A block the destination refuses (bad data: nothing of it written) and a
block tried beside it whose outcome is unknown (it landed, its answer was
lost), both handed to an ``"outage"`` spool: the unknown one is repeated
before the refused one is split.

The spool splits a refused block in halves until only the refused records
are left, and every half that is taken is an insert of its own.  Spooled
behind such a block (the sinks handed blocks over in the order sealed), the
other one's repeat came after every one of those inserts (4 here): out of
the window, its rows written twice (steps 101-116 twice, in all four cases
below).  Now a refused block is handed over behind the blocks tried beside
it (``TableOrder.requeue``), and every row is there once.  Real
chDB (in a writer process, and in-process), a real refusal (a CHECK
constraint), a window of 3 (what ``inserts_in_flight = 2`` needs); the lost
answer is injected where the existing order tests inject it.  Nothing here
waits by sleeping."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
import trio

from taproute.native import make_descriptors
from taproute.routing import HookRegistry, RecordBatch
from taproute.service.sinks.clickhouse import Batching
from taproute.service.sinks.spool import Spool, SpoolConfig
from taproute.service.sinks.spool.spooling import Backoff, SpoolingSink
from taproute.service.sinks.writer import WriterProcessSink
from taproute.service.sinks.writer.blocks import SENT
from taproute.service.sinks.writer.protocol import Done, Failed
from tests.clickhouse_backends import Backend
from tests.test_writer_process import SCHEMA, WIDTH
from tests.test_writer_spool import GUARD_S

#: The refused block: 16 records, steps 1..16; only step 16 breaks the
#: table's constraint, so its splits land 4 inserts (8, 4, 2 and 1 records)
#: before the lone bad record is refused for good.
REFUSED_STEPS = list(range(1, 17))
BAD_STEP = 16
#: The block tried beside it, whose answer is lost after it landed.
LOST_STEPS = list(range(101, 117))


def steps_batch(hook: int, steps: list[int]) -> RecordBatch:
    """One ``acts`` record per step, every value its step."""
    n = len(steps)
    descriptors = make_descriptors(
        hook,
        np.full(n, WIDTH * 4),
        offsets=np.arange(n) * WIDTH * 4,
        layout_ids=SCHEMA.layout_id("acts"),
        keys=np.arange(n) % 4,
        steps=np.asarray(steps),
    )
    return RecordBatch.from_buffer(descriptors, np.repeat(np.asarray(steps, np.float32), WIDTH))


def spool_config(tmp_path, full: bool) -> SpoolConfig:
    """``full``: a spool that takes one frame at a time (every append waits,
    for good, until the drain has acknowledged what it holds)."""
    if not full:
        return SpoolConfig(directory=tmp_path / "spool")
    return SpoolConfig(
        directory=tmp_path / "spool", quota_bytes=1, when_full="block", block_timeout=math.inf
    )


def spooling(inner, config: SpoolConfig, dead: list[RecordBatch], **kwargs) -> SpoolingSink:
    """``inner`` behind a spool (quick backoff) whose dead letters go to ``dead``."""

    async def dead_letter(batch, reason):
        dead.append(batch)

    return SpoolingSink(
        "ch",
        inner,
        Spool.open(config),
        backoff=Backoff(initial=0.01, maximum=0.05),
        dead_letter=dead_letter,
        **kwargs,
    )


async def deliver_both_then_check(sink, hook: int, dead: list[RecordBatch], query, table: str):
    """Submit the block with the refused record, then the one whose answer is
    lost beside it (a block each: ``max_rows``); once all is delivered and the
    sink closed, every good row is in ``table`` once, the bad one
    dead-lettered, and the counts add up."""
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        with trio.fail_after(GUARD_S):
            await sink.submit(steps_batch(hook, REFUSED_STEPS))
            await sink.submit(steps_batch(hook, LOST_STEPS))
            await sink.wait_delivered()
            await sink.close()
    assert sink.failure is None
    rows = query(f"SELECT step, count() AS n FROM {table} GROUP BY step ORDER BY step")
    assert rows.to_pylist() == expected_steps()
    assert [int(s) for b in dead for s in b.descriptors["step"]] == [BAD_STEP]
    c = sink.snapshot()
    assert c.refused_records == 1
    assert c.accepted_records == c.delivered_records + c.refused_records == 32


def small_window_and_a_constraint(table: str) -> list[str]:
    """``table`` remembers its last 3 blocks (what ``inserts_in_flight = 2``
    needs) and refuses a block holding a record of step BAD_STEP."""
    return [
        f"ALTER TABLE `{table}` MODIFY SETTING non_replicated_deduplication_window = 3",
        f"ALTER TABLE `{table}` ADD CONSTRAINT no_bad_step CHECK step != {BAD_STEP}",
    ]


def expected_steps() -> list[dict[str, int]]:
    steps = [s for s in REFUSED_STEPS if s != BAD_STEP] + LOST_STEPS
    return [{"step": s, "n": 1} for s in steps]


@pytest.mark.parametrize("full", [False, True], ids=["spool", "full_spool"])
async def test_writer_a_lost_answer_beside_a_refused_block_is_repeated_before_its_splits(
    tmp_path, full
):
    setup = WriterProcessSink.embedded(SCHEMA, tmp_path / "data", raw=["acts"])
    try:
        for sql in small_window_and_a_constraint("raw_acts"):
            setup.query(sql)
    finally:
        setup.close_unstarted()
    batching = Batching(max_rows=16, inserts_in_flight=2, linger=3600)
    writer = WriterProcessSink.embedded(SCHEMA, tmp_path / "data", raw=["acts"], batching=batching)
    hooks = HookRegistry()
    hook = hooks.bind("h.0", layout="acts")
    dead: list[RecordBatch] = []
    sink = spooling(writer, spool_config(tmp_path, full), dead)
    sink.use_hooks(hooks)
    lost: list[int] = []
    handle = writer._on_message

    def on_message(message: object) -> None:
        # The first block of the batched path the writer persists (the refused
        # one never is) is answered as failed: its rows are in the table.
        block = writer._blocks.get(getattr(message, "block", -1))
        own = block is not None and block.waiter is None and block.state == SENT
        if isinstance(message, Done) and own and not lost:
            lost.append(message.block)
            message = Failed(
                message.block,
                TimeoutError("answer lost after the insert was stored (injected)"),
                transient=True,
            )
        handle(message)

    writer._on_message = on_message  # type: ignore[method-assign]
    await deliver_both_then_check(sink, hook, dead, writer.query, "raw_acts")
    assert lost


class LosesAnAnswer:
    """The real transport; the insert of ``token`` (its first try) raises
    after ClickHouse stored it, as a reply lost on the way back."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.description = inner.description
        self.token = ""
        self.lost = False
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def insert(self, table, data, *, dedup_token, settings=None):
        self.inner.insert(table, data, dedup_token=dedup_token, settings=settings)
        with self._lock:
            if dedup_token != self.token or self.lost:
                return
            self.lost = True
        raise TimeoutError("answer lost after the insert was stored (injected)")


@pytest.mark.parametrize("full", [False, True], ids=["spool", "full_spool"])
async def test_in_process_a_lost_answer_beside_a_refused_block_is_repeated_before_its_splits(
    chdb_transport, tmp_path, full
):
    backend = Backend("chdb", chdb_transport)
    hooks = HookRegistry()
    hook = hooks.bind("h.0", layout="acts")
    backend.sink(SCHEMA, raw=["acts"], hooks=hooks).release_transport()  # the table
    for sql in small_window_and_a_constraint(backend.raw("acts")):
        chdb_transport.execute(sql)
    batching = Batching(max_rows=16, inserts_in_flight=2, linger=3600)
    faults = LosesAnAnswer(chdb_transport)
    inner = backend.sink(SCHEMA, transport=faults, raw=["acts"], hooks=hooks, batching=batching)
    # The sink's second block (the one sealed after the refused one).
    faults.token = f"{inner._token_prefix}-2-{backend.raw('acts')}"
    dead: list[RecordBatch] = []
    sink = spooling(inner, spool_config(tmp_path, full), dead)
    await deliver_both_then_check(sink, hook, dead, backend.query, "{p}_raw_acts")
    assert faults.lost


class HoldsAfter:
    """The real transport; the insert after ``landed`` stored ones holds (a
    process about to be killed) until :attr:`hold` is set, then fails."""

    def __init__(self, inner, landed: int) -> None:
        self.inner = inner
        self.description = inner.description
        self.landed = landed
        self.stored = 0
        self.hold = threading.Event()
        self.held = trio.Event()
        self._loop = trio.lowlevel.current_trio_token()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def insert(self, table, data, *, dedup_token, settings=None):
        if self.stored >= self.landed:
            self._loop.run_sync_soon(self.held.set)
            self.hold.wait(GUARD_S)
            raise ConnectionError("the process is gone (injected)")
        self.inner.insert(table, data, dedup_token=dedup_token, settings=settings)
        self.stored += 1


async def test_a_refused_group_split_then_cut_short_is_not_written_twice_after_a_restart(
    chdb_transport, tmp_path
):
    """A spooled group with one refused record is split in halves; the
    process is killed (its sink cut, nothing acknowledged) once 4 parts
    landed.  The restart repeated every part under its token, but behind 3
    later parts each (refusals store no block) they were out of the window,
    and all 15 good rows were written twice.  Now each part delivered is
    recorded with the group's intent (the spool's ``pieces``) and skipped
    after a restart: every row once."""
    backend = Backend("chdb", chdb_transport)
    hooks = HookRegistry()
    hook = hooks.bind("h.0", layout="acts")
    backend.sink(SCHEMA, raw=["acts"], hooks=hooks).release_transport()  # the table
    for sql in small_window_and_a_constraint(backend.raw("acts")):
        chdb_transport.execute(sql)
    dead: list[RecordBatch] = []

    def always_spooling(transport) -> SpoolingSink:
        inner = backend.sink(SCHEMA, transport=transport, raw=["acts"], hooks=hooks)
        return spooling(inner, SpoolConfig(directory=tmp_path / "spool"), dead, mode="always")

    faults = HoldsAfter(chdb_transport, landed=4)  # 8, 4, 2 and 1 records
    sink = always_spooling(faults)
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        with trio.fail_after(GUARD_S):
            await sink.submit(steps_batch(hook, REFUSED_STEPS))
            await faults.held.wait()  # 4 parts landed, the last one's try holds
        await sink.release_when_cut()  # killed: nothing acknowledged
        nursery.cancel_scope.cancel()
    faults.hold.set()
    assert faults.stored == 4 and dead == []
    again = always_spooling(chdb_transport)
    async with trio.open_nursery() as nursery:
        await nursery.start(again.run)
        with trio.fail_after(GUARD_S):
            await again.wait_delivered()
            await again.close()
    assert again.failure is None
    rows = backend.query(
        "SELECT step, count() AS n FROM {p}_raw_acts GROUP BY step ORDER BY step"
    ).to_pylist()
    assert rows == [{"step": s, "n": 1} for s in REFUSED_STEPS if s != BAD_STEP]
    assert [int(s) for b in dead for s in b.descriptors["step"]] == [BAD_STEP]
    assert again.snapshot().spool.acked_records == 16
