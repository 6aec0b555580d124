"""Which path a batch takes through a spooling destination in ``outage`` mode:
the ClickHouse sink's own batched path while it is healthy and keeps up, the
spool when it is down or behind, splitting when it refuses some records.

Real chDB underneath, faults injected by the transport (tests/test_spool_outage.py).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import trio
import trio.testing

from taproute.routing import HookRegistry, RowBatch
from taproute.service.sinks.clickhouse import Batching
from taproute.service.sinks.spool import Spool, SpoolConfig
from taproute.service.sinks.spool.spooling import Backoff, SpoolingSink
from tests.clickhouse_backends import FlakyTransport
from tests.conftest import vec_batch
from tests.processors import SCHEMA
from tests.test_spool_outage import FaultyTransport, Refused, stored
from tests.test_spool_outage import backend as backend
from tests.test_spool_outage import clock as clock


class HeldTransport(FaultyTransport):
    """Inserts wait (in their worker thread) until ``release`` is set: a slow
    destination.  ``held_too_long``: an insert gave up waiting after 60 s (real
    time), as one does when the test itself waits on the held insert."""

    def __init__(self, inner, **kwargs):
        super().__init__(inner, **kwargs)
        self.release = threading.Event()
        self.waiting = 0
        self.held_too_long = False

    def insert(self, table, data, *, dedup_token, settings=None):
        with self._lock:
            self.waiting += 1
        if not self.release.wait(timeout=60):
            self.held_too_long = True
        super().insert(table, data, dedup_token=dedup_token, settings=settings)


class SizedTransport(FaultyTransport):
    """Records the rows of every insert."""

    def __init__(self, inner, **kwargs):
        super().__init__(inner, **kwargs)
        self.sizes: list[int] = []

    def insert(self, table, data, *, dedup_token, settings=None):
        super().insert(table, data, dedup_token=dedup_token, settings=settings)
        self.sizes.append(data.num_rows)


def spooling(backend, tmp_path, transport, *, batching, dead=None, **kwargs):
    hooks = HookRegistry()
    hooks.bind("q", layout="vec")
    inner = backend.sink(SCHEMA, transport=transport, raw=["vec"], hooks=hooks, batching=batching)

    async def dead_letter(batch, reason):
        dead.append((batch, reason))

    return SpoolingSink(
        "ch",
        inner,
        Spool.open(SpoolConfig(directory=tmp_path / "spool"), clock=trio.current_time),
        backoff=Backoff(initial=0.5, maximum=5.0),
        dead_letter=None if dead is None else dead_letter,
        clock=trio.current_time,
        **kwargs,
    )


async def test_healthy_outage_mode_is_the_sinks_own_batched_path(backend, tmp_path, clock):
    faults = SizedTransport(backend.transport)
    sink = spooling(backend, tmp_path, faults, batching=Batching(max_rows=100, linger=1.0))
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        for i in range(50):
            await sink.submit(vec_batch(0, 4, seq_start=i * 4))
            await trio.sleep(0.01)  # the destination keeps up: nothing queues
        await sink.flush()
        # max_rows=100: 200 records are two inserts, exactly as without a spool
        assert faults.sizes == [100, 100]
        await sink.close()
    assert stored(backend) == (200, 200)
    c = sink.snapshot()
    assert c.accepted_records == c.delivered_records == 200 and c.memory_records == 0
    assert c.spool.appended_batches == 0 and not (tmp_path / "spool" / "ack").exists()


async def test_a_block_that_fails_on_the_batched_path_is_spooled_under_its_token(
    backend, tmp_path, clock
):
    # Every 2nd insert loses its reply after storing the rows: the spooled
    # block keeps the token it was tried with, so the replay is a no-op.
    faults = FaultyTransport(backend.transport, lose_every=2)
    sink = spooling(backend, tmp_path, faults, batching=Batching(max_rows=20, linger=1.0))
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        for i in range(10):
            await sink.submit(vec_batch(0, 4, seq_start=i * 4))
            await trio.sleep(0.3)
        await sink.wait_delivered()
        await sink.close()
    assert faults.lost >= 1
    assert stored(backend) == (40, 40)  # the lost reply's block is there once
    c = sink.snapshot()
    assert c.spool.appended_batches >= 1 and c.spool.frames == 0
    assert c.accepted_records == c.delivered_records == 40
    assert sink.health.healthy and sink.failure is None


async def test_a_refused_block_on_the_batched_path_dead_letters_only_the_bad_record(
    backend, tmp_path, clock
):
    faults = FaultyTransport(backend.transport, refuse={37})
    dead: list = []
    sink = spooling(backend, tmp_path, faults, batching=Batching(max_rows=64), dead=dead)
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        for i in range(16):
            await sink.submit(vec_batch(0, 4, seq_start=i * 4))
        await sink.flush()  # returns with the refused block durable in the spool
        await sink.wait_delivered()
        await sink.close()
    ((batch, reason),) = dead
    assert list(batch.descriptors["seq"]) == [37] and "TYPE_MISMATCH" in reason
    assert stored(backend) == (63, 63)
    c = sink.snapshot()
    assert c.accepted_records == 64 == c.delivered_records + c.refused_records
    assert c.refused_records == 1 and sink.failure is None
    # The refused block was split from the spool (durable first); refused is
    # not unreachable: the destination stayed healthy throughout.
    assert c.spool.appended_batches >= 1 and c.spool.frames == 0
    assert sink.health.healthy and c.retries == 0


async def test_a_destination_behind_spills_to_the_spool_and_drains_back_in_order(
    backend, tmp_path, clock
):
    slow = HeldTransport(backend.transport)
    batching = Batching(max_rows=8, max_buffered_bytes=2048, inserts_in_flight=1)
    sink = spooling(backend, tmp_path, slow, batching=batching, spill_at=0.5)
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        # Never waits on the slow destination: every submission returns while
        # an insert is held.  (Not a mock-time bound: the clock stands still
        # while the held insert's thread runs; a submission that waited on it
        # would wait out its 60 s hold, and held_too_long says so below.)
        for i in range(40):
            await sink.submit(vec_batch(0, 4, seq_start=i * 4))
        assert not slow.held_too_long
        c = sink.snapshot()
        assert c.spilled_records > 0 and c.spool.frames > 0
        assert sink.health.healthy  # behind is not down
        assert sink.spool_status().bytes > 0
        slow.release.set()
        await sink.wait_delivered()
        await sink.close()
    assert stored(backend) == (160, 160)
    c = sink.snapshot()
    assert c.accepted_records == c.delivered_records == 160
    # What the sink held when the spill began went to the spool first (its
    # blocks handed over, the held insert's too), then what spilled.
    assert c.spool.frames == 0 and c.spool.acked_records == c.spool.appended_records
    assert c.spool.appended_records > c.spilled_records
    # The spilled frames drained as grouped inserts, not one insert per batch.
    assert slow.inserts < 40
    assert not slow.held_too_long


class TableFaults(FaultyTransport):
    """Faults of one table only: the ``norm`` rows table is unreachable while
    ``rows_down``, and refuses a block holding a seq in ``refuse_rows``."""

    def __init__(self, inner, *, refuse_rows=()):
        super().__init__(inner)
        self.rows_down = False
        self.refuse_rows = set(refuse_rows)

    def insert(self, table, data, *, dedup_token, settings=None):
        if table.endswith("_norm"):
            if self.rows_down:
                with self._lock:
                    self.unreachable += 1
                raise ConnectionRefusedError("rows table unreachable (injected)")
            if self.refuse_rows & set(data.column("seq").to_pylist()):
                raise Refused("Code: 53. DB::Exception: TYPE_MISMATCH (injected)")
        super().insert(table, data, dedup_token=dedup_token, settings=settings)


def norm_rows(seq_start: int, n: int) -> RowBatch:
    rows = np.zeros(n, SCHEMA.layout("norm").dtype)
    rows["seq"] = np.arange(seq_start, seq_start + n)
    rows["norm"] = 1.0
    return RowBatch(route="norms", layout_name="norm", rows=rows)


async def test_a_group_stored_in_one_table_but_not_the_other_is_never_written_twice(
    backend, tmp_path, clock
):
    # Each group holds raw records (table raw_vec) and rows (table norm): the
    # raw part is stored, then the rows part fails (unreachable for a minute,
    # and one row refused).  The retries and the split never store a raw
    # record twice, and only the refused row is dead-lettered.
    hooks = HookRegistry()
    hooks.bind("q", layout="vec")
    faults = TableFaults(backend.transport, refuse_rows={45})
    inner = backend.sink(SCHEMA, transport=faults, raw=["vec"], rows=["norm"], hooks=hooks)
    dead: list = []

    async def dead_letter(batch, reason):
        dead.append((batch, reason))

    sink = SpoolingSink(
        "ch",
        inner,
        Spool.open(SpoolConfig(directory=tmp_path / "spool"), clock=trio.current_time),
        mode="always",
        backoff=Backoff(initial=0.5, maximum=5.0),
        dead_letter=dead_letter,
        clock=trio.current_time,
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        faults.rows_down = True
        for i in range(12):
            await sink.submit(vec_batch(0, 4, seq_start=i * 4))
            await sink.submit(norm_rows(i * 4, 4))
            await trio.sleep(5.0)
        assert not sink.health.healthy and faults.unreachable > 1
        faults.rows_down = False
        await sink.wait_delivered()
        await sink.close()
    assert stored(backend) == (48, 48)  # raw: every record once, though retried
    rows = backend.query("SELECT count() AS n, uniqExact(seq) AS u FROM {p}_norm").to_pylist()
    assert rows == [{"n": 47, "u": 47}]
    ((batch, reason),) = dead
    assert isinstance(batch, RowBatch) and list(batch.rows["seq"]) == [45]
    assert "TYPE_MISMATCH" in reason
    c = sink.snapshot()
    assert c.accepted_records == 96 == c.delivered_records + c.refused_records
    assert c.refused_records == 1 and sink.failure is None


class RefusingInner:
    """An inner sink that records every try's token and refuses any try
    holding a seq in ``bad`` (the split's bookkeeping, without a database)."""

    def __init__(self, bad):
        self.bad = set(bad)
        self.tries: list[tuple[str, list[int]]] = []
        self.stored: list[int] = []

    async def insert_now(self, batches, token):
        seqs = [int(s) for b in batches for s in b.descriptors["seq"]]
        self.tries.append((token, seqs))
        if self.bad & set(seqs):
            raise Refused("Code: 53. DB::Exception: TYPE_MISMATCH (injected)")
        self.stored.extend(seqs)

    def is_transient(self, error):
        return False

    async def submit(self, batch):
        raise AssertionError("not used")

    async def flush(self):
        pass

    async def close(self):
        pass


async def test_a_refused_group_splits_the_same_way_every_time(tmp_path):
    from taproute.routing.latch import FailureLatch
    from taproute.service.sinks.spool.delivery import Delivery
    from taproute.service.sinks.spool.health import HealthTracker, SpoolingCounters

    async def run() -> tuple[RefusingInner, list]:
        inner = RefusingInner(bad={3, 12})
        dead: list = []

        async def dead_letter(batch, reason):
            dead.append([int(s) for s in batch.descriptors["seq"]])

        delivery = Delivery(
            "ch",
            inner,
            None,
            HealthTracker(trio.current_time, Backoff()),
            SpoolingCounters(),
            FailureLatch(),
            dead_letter=dead_letter,
            group_bytes=1 << 20,
        )
        group = [vec_batch(0, 5, seq_start=0), vec_batch(0, 11, seq_start=5)]
        delivered = await delivery.settle(group, "spool-x-1-2")
        assert delivered == 14
        return inner, dead

    first, dead = await run()
    again, _ = await run()
    assert dead == [[3], [12]]  # only the refused records
    assert sorted(first.stored) == [s for s in range(16) if s not in (3, 12)]
    # A replay (after a crash) tries the same parts under the same tokens,
    # so what was stored before is recognised as a repeat.
    assert again.tries == first.tries
    tokens = [token for token, _ in first.tries]
    assert tokens[0] == "spool-x-1-2" and len(set(tokens)) == len(tokens)
    assert all(t.startswith("spool-x-1-2.") for t in tokens[1:])


# -- exactly once into a partitioned table (see tests/test_clickhouse.py) ----------

PARTITIONED = (
    "MergeTree PARTITION BY seq % 4 ORDER BY tuple() "
    "SETTINGS non_replicated_deduplication_window = {window}"
)


async def test_a_handed_over_block_is_repeated_before_the_tables_later_blocks(
    backend, tmp_path, clock
):
    """Five blocks of 40 rows, each 4 blocks to ClickHouse (4 partitions), into
    a window of 12; the first reply lost, so its block goes to the spool under
    its token.  The sink went on inserting the later blocks itself while the
    spool waited out its backoff, their 16 parts pushed the lost one's out of
    the window, and the spool's repeat wrote its rows again (220 or 240 rows for
    200).  Now the table's blocks not started yet follow it into the spool,
    in order, untried: the repeat lands behind at most 2 other inserts, and
    each row is there once."""
    backend.create_raw_vec(PARTITIONED.format(window=12))
    flaky = FlakyTransport(backend.transport, failures=1)
    sink = spooling(backend, tmp_path, flaky, batching=Batching(max_rows=40, linger=60.0))
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        for i in range(5):
            await sink.submit(vec_batch(0, 40, seq_start=40 * i))
        await sink.wait_delivered()
        await sink.close()
    assert stored(backend) == (200, 200)
    c = sink.snapshot()
    assert c.spool.appended_batches >= 3 and c.spool.frames == 0  # it and 2+ held back
    assert c.accepted_records == c.delivered_records == 200 and sink.failure is None


class LosesFirstReplies(FaultyTransport):
    """The first try of every token is stored and its reply lost."""

    def __init__(self, inner, **kwargs):
        super().__init__(inner, **kwargs)
        self.tried: set[str] = set()

    def insert(self, table, data, *, dedup_token, settings=None):
        super().insert(table, data, dedup_token=dedup_token, settings=settings)
        if dedup_token not in self.tried:
            self.tried.add(dedup_token)
            self.lost += 1
            raise TimeoutError("reply lost after the insert was stored (injected)")


async def test_a_spool_replays_into_a_short_window_in_pieces_each_row_once(
    backend, tmp_path, clock
):
    """A spooled group of 16 rows over 4 partitions is 4 blocks to ClickHouse;
    a window of 3 passed the check, and the repeat of its lost reply wrote
    rows twice.  Now such a group touches more partitions than the window
    holds per insert (3 holds 1 for each of the 3 inserts a repeat may
    follow): ClickHouse refuses it with nothing written and the drain splits
    it until each piece fits.  Every piece's first reply is lost too, and
    every row lands once, none dead-lettered (the refusal is not the
    records')."""
    backend.create_raw_vec(PARTITIONED.format(window=3))
    faults = LosesFirstReplies(backend.transport)
    faults.down = True
    dead: list = []
    sink = spooling(backend, tmp_path, faults, batching=Batching(max_rows=16), dead=dead)
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        for i in range(4):
            await sink.submit(vec_batch(0, 4, seq_start=4 * i))
        await sink.flush()  # durable in the spool: the destination is down
        faults.down = False
        await sink.wait_delivered()
        await sink.close()
    assert stored(backend) == (16, 16)
    assert faults.lost >= 16 and dead == [] and sink.failure is None  # single rows, each lost once
    c = sink.snapshot()
    assert c.accepted_records == c.delivered_records == 16 and c.refused_records == 0


class HeldFirstInsert(FaultyTransport):
    """The first insert is held until ``lose`` is set, then its answer is lost
    (``TimeoutError``): a block whose outcome stays unknown for as long as
    the test wants.  ``stored_first``: it is stored before it is held (else
    when let go: a try that lands late).  ``running``: inserts in their
    threads now; ``after_first``: other inserts stored."""

    def __init__(self, inner, *, stored_first=True, **kwargs):
        super().__init__(inner, **kwargs)
        self.stored_first = stored_first
        self.lose = threading.Event()
        self.first: str | None = None
        self.holding = False  # the first insert is in its thread, held
        self.held = threading.Event()  # the same, for another thread
        self.running = 0
        self.after_first = 0

    def insert(self, table, data, *, dedup_token, settings=None):
        with self._lock:
            self.running += 1
            held = self.first is None
            if held:
                self.first = dedup_token
        try:
            if held:
                if self.stored_first:
                    super().insert(table, data, dedup_token=dedup_token, settings=settings)
                self.holding = True
                self.held.set()
                self.lose.wait(timeout=60)  # the test sets it; 60 s only guards a hang
                if not self.stored_first:
                    super().insert(table, data, dedup_token=dedup_token, settings=settings)
                raise TimeoutError("reply lost after the insert was stored (injected)")
            super().insert(table, data, dedup_token=dedup_token, settings=settings)
            with self._lock:
                self.after_first += 1
        finally:
            with self._lock:
                self.running -= 1


UNPARTITIONED = "MergeTree ORDER BY tuple() SETTINGS non_replicated_deduplication_window = {window}"


@pytest.mark.parametrize(
    "stored_first", [True, False], ids=["stored-then-held", "held-then-stored"]
)
async def test_a_block_whose_outcome_is_unknown_when_batches_spill_is_repeated_before_them(
    backend, tmp_path, clock, stored_first
):
    """A window of 3 (what inserts_in_flight = 2 needs).  The first block's
    insert is held in its thread (stored first, or stored when let go), and
    the destination is behind, so the next six batches spill to the spool.
    The drain inserted them while the first block's outcome was unknown, and
    when its answer came (lost) the block went to the spool behind them: its
    repeat came 6 inserts after its first try, out of the window, and wrote
    its 4 rows again (32 rows for 28; stored-then-held).  Now a spill first
    hands the sink's unfinished blocks to the spool, in the table's order,
    an insert running left to finish in its thread; the drain repeats such a
    block before anything spilled after it, and only once that try has
    returned: a try that lands late (held-then-stored) is not left to land
    behind the spilled batches' inserts, out of the window."""
    backend.create_raw_vec(UNPARTITIONED.format(window=3))
    faults = HeldFirstInsert(backend.transport, stored_first=stored_first)
    batching = Batching(max_rows=4, max_buffered_bytes=128, inserts_in_flight=2, linger=60.0)
    sink = spooling(backend, tmp_path, faults, batching=batching, spill_at=0.5, group_bytes=1)
    assert sink.spool is not None
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        await sink.submit(vec_batch(0, 4))  # a block (max_rows): its insert starts
        while not faults.holding:  # stored, in its worker thread
            await trio.testing.wait_all_tasks_blocked()
        for i in range(1, 7):
            await sink.submit(vec_batch(0, 4, seq_start=4 * i))
        assert sink.snapshot().spilled_records == 24
        # Quiet: no task runs, no insert but the held one, and either the
        # drain has inserted the six spilled batches, or no worker thread is
        # awaited (the held insert given up waiting for, the drain waiting).
        # Then the held insert goes on and its answer is lost.
        while True:
            await trio.testing.wait_all_tasks_blocked()
            idle = clock.autojump_threshold == 0  # thread_aware_clock: no thread awaited
            if faults.running == 1 and (faults.after_first >= 6 or idle):
                break
        faults.lose.set()
        await sink.wait_delivered()
        await sink.close()
    assert stored(backend) == (28, 28)
    c = sink.snapshot()
    assert c.accepted_records == c.delivered_records == 28 and sink.failure is None


class RefusedWhileHeld(HeldFirstInsert):
    """The first insert fails as unreachable (nothing stored) once the next
    one is held (see :class:`HeldFirstInsert`, which that one is)."""

    def __init__(self, inner, **kwargs):
        super().__init__(inner, **kwargs)
        self.calls = 0

    def insert(self, table, data, *, dedup_token, settings=None):
        with self._lock:
            self.calls += 1
            refuse = self.calls == 1
        if refuse:
            self.held.wait(timeout=60)  # 60 s only guards a hang
            raise ConnectionRefusedError("destination unreachable (injected)")
        super().insert(table, data, dedup_token=dedup_token, settings=settings)


async def test_a_block_whose_outcome_is_unknown_when_the_destination_goes_down_is_repeated_first(
    backend, tmp_path, clock
):
    """The same with the destination down: of the sink's two inserts, the
    second is stored and its answer held, the first fails as unreachable,
    and the next six batches go to the spool while the second's outcome is
    unknown.  They went in ahead of it, the drain inserted them, and its
    repeat, behind them, wrote its rows again (36 rows for 32).  Now they go
    in behind it."""
    backend.create_raw_vec(UNPARTITIONED.format(window=3))
    faults = RefusedWhileHeld(backend.transport)
    batching = Batching(max_rows=4, inserts_in_flight=2, linger=60.0)
    sink = spooling(backend, tmp_path, faults, batching=batching, group_bytes=1)
    assert sink.spool is not None
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        await sink.submit(vec_batch(0, 4))  # a block (max_rows): its insert starts
        while not faults.calls:
            await trio.testing.wait_all_tasks_blocked()
        await sink.submit(vec_batch(0, 4, seq_start=4))  # the second, held
        while sink.health.healthy:  # the first failed, handed to the spool
            await trio.testing.wait_all_tasks_blocked()
        for i in range(2, 8):
            await sink.submit(vec_batch(0, 4, seq_start=4 * i))
        while True:  # quiet, as above (the first's repeat and the six, or waiting)
            await trio.testing.wait_all_tasks_blocked()
            idle = clock.autojump_threshold == 0
            if faults.running == 1 and (faults.after_first >= 7 or idle):
                break
        faults.lose.set()
        await sink.wait_delivered()
        await sink.close()
    assert stored(backend) == (32, 32)
    c = sink.snapshot()
    assert c.accepted_records == c.delivered_records == 32 and sink.failure is None
