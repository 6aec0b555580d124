"""Batches taken at one wake-up are handed on merged into one, without a copy,
when their payloads lie in one region of the runtime's ``arena`` (the writer
process's shared pool): every record arrives, in queue order, with its own
bytes; each producer's release fires exactly once, after the last holder of
the merged batch is done; batches the arena cannot span, and controls, split
the merge so nothing is reordered.

No test depends on timing: merges are forced by queueing the batches before
the runtime starts (its first take finds them all); real-time bounds are
hang guards only.
"""

from __future__ import annotations

import threading
from collections import Counter

import numpy as np
import pytest

from taproute.native import BufferLease, LeaseError, PartsLease, make_descriptors
from taproute.routing import Batch, RecordBatch, Route, RoutingConfig, RowBatch
from taproute.service import RoutingSink
from taproute.service.host.batch_merge import SpansPayloads, merge
from taproute.service.host.runtime import RecordRuntime
from taproute.service.sinks.capture import CaptureSink
from taproute.service.sinks.writer.shared_pool import SharedBufferPool
from tests.processors import SCHEMA, VEC

Q = "layers.0.attn.q"
K = "layers.0.attn.k"
HANG_GUARD_S = 60.0
RECORD = 16  # bytes of one "vec" record (4 float32)


def _vectors(records: int, key: int) -> np.ndarray:
    return (np.arange(records * 4, dtype=np.float32) + 100 * key).reshape(records, 4)


class Releases:
    """Release callbacks that count their calls, per batch."""

    def __init__(self) -> None:
        self.calls: Counter[int] = Counter()
        self._lock = threading.Lock()

    def of(self, key: int):
        def release() -> None:
            with self._lock:
                self.calls[key] += 1

        return release


def _pooled_batch(
    pool: SharedBufferPool, output_id: int, key: int, records: int, releases: Releases
) -> RecordBatch:
    """A batch of ``records`` vec records (key ``key``) in a pool buffer."""
    values = _vectors(records, key)
    buffer = pool.take_array(values.nbytes)
    buffer[: values.nbytes] = values.reshape(-1).view(np.uint8)
    desc = make_descriptors(
        output_id,
        RECORD,
        count=records,
        layout_ids=SCHEMA.layout_id("vec"),
        keys=key,
        seqs=np.arange(records) + 10 * key,
    )
    release = releases.of(key)
    return RecordBatch.from_buffer(
        desc, buffer[: values.nbytes], lambda: (pool.give_back(buffer), release())
    )


def _records(batch: RecordBatch) -> list[tuple[int, int, bytes]]:
    """(key, seq, payload bytes) of every record of ``batch``, in order."""
    return [
        (int(d["key"]), int(d["seq"]), batch.payload_of(i).tobytes())
        for i, d in enumerate(batch.descriptors)
    ]


# -- the pool's span ------------------------------------------------------------


def test_the_pool_cuts_arrays_into_runs_of_one_segment_each_with_one_view():
    pool = SharedBufferPool(segment_bytes=4 * 4096)
    first, second = pool.take_array(100), pool.take_array(5000)
    first[:100] = 1
    second[:5000] = 2
    third = pool.take_array(4096)  # 4 + 8 + 4 KiB: segment 0 is full
    fourth = pool.take_array(4096)  # so this one is carved from segment 1
    fifth = pool.take_array(4096)
    assert isinstance(pool, SpansPayloads)
    loose = np.zeros(100, dtype=np.uint8)
    runs = pool.spans([second[:5000], first[:100], loose, third, fourth, fifth, loose])
    assert [(count, view is None) for count, view, _ in runs] == [
        (2, False),  # second, first: segment 0
        (1, True),  # not in the pool
        (1, True),  # third: alone in segment 0 (fourth is in segment 1)
        (2, False),  # fourth, fifth: segment 1
        (1, True),
    ]
    _, view, starts = runs[0]
    assert view is not None and not view.flags.writeable
    assert view[starts[0] : starts[0] + 5000].tobytes() == b"\2" * 5000
    assert view[starts[1] : starts[1] + 100].tobytes() == b"\1" * 100
    assert np.shares_memory(view, first) and np.shares_memory(view, second)  # no copy
    view = runs[3][1]
    assert view is not None and np.shares_memory(view, fourth) and np.shares_memory(view, fifth)
    assert not np.shares_memory(view, third)
    pool.close()
    assert [count for count, view, _ in pool.spans([first, second])] == [1, 1]  # closed: none


# -- merge() --------------------------------------------------------------------


def test_merge_keeps_every_record_and_its_bytes_in_order_without_copying():
    pool = SharedBufferPool()
    releases = Releases()
    batches = [
        _pooled_batch(pool, output_id=k % 2, key=k, records=k + 1, releases=releases)
        for k in range(4)
    ]
    out, merged_count = merge(batches, pool)
    assert merged_count == 4 and len(out) == 1
    merged = out[0]
    assert _records(merged) == [r for b in batches for r in _records(b)]
    assert merged.nbytes == sum(b.nbytes for b in batches)
    assert list(merged.descriptors["output_id"]) == [
        int(o) for b in batches for o in b.descriptors["output_id"]
    ]
    for batch in batches:
        assert np.shares_memory(merged.payload, batch.payload)
    pool.close()


def test_a_merged_batch_releases_each_producer_buffer_once_after_its_last_holder():
    pool = SharedBufferPool()
    releases = Releases()
    batches = [_pooled_batch(pool, 0, key=k, records=3, releases=releases) for k in range(3)]
    (merged,), _ = merge(batches, pool)
    hold = merged.select(np.array([4], dtype=np.intp)).retain()  # a destination keeps one record
    merged.lease.release()  # the record worker is done with it
    assert releases.calls == Counter({0: 1, 2: 1})  # record 4 lies in batch 1's buffer
    hold.release()
    assert releases.calls == Counter({0: 1, 1: 1, 2: 1})
    hold.release()  # a second release of the same hold changes nothing
    assert releases.calls == Counter({0: 1, 1: 1, 2: 1})
    pool.close()


def test_a_merged_lease_gives_every_lease_back_even_when_one_callback_raises():
    pool = SharedBufferPool()
    releases = Releases()
    good = [_pooled_batch(pool, 0, key=k, records=1, releases=releases) for k in (1, 2)]

    def broken() -> None:
        raise RuntimeError("pool gone")

    bad = RecordBatch.from_buffer(make_descriptors(0, RECORD, count=1), bytes(RECORD), broken)
    merged = PartsLease.merged([good[0].lease, bad.lease, good[1].lease])
    with pytest.raises(RuntimeError, match="pool gone"):
        merged.release()
    assert releases.calls == Counter({1: 1, 2: 1})
    assert bad.lease.released and merged.released
    with pytest.raises(LeaseError):
        merged.release()  # once only
    assert releases.calls == Counter({1: 1, 2: 1})
    pool.close()


def test_merge_leaves_a_batch_the_arena_cannot_span_alone_and_in_its_place():
    pool = SharedBufferPool()
    releases = Releases()
    first, second = (_pooled_batch(pool, 0, key=k, records=2, releases=releases) for k in (1, 2))
    loose = RecordBatch.from_buffer(
        make_descriptors(0, RECORD, count=2), _vectors(2, 3).tobytes(), releases.of(3)
    )
    last = _pooled_batch(pool, 0, key=4, records=1, releases=releases)
    out, merged = merge([first, second, loose, last], pool)
    assert merged == 2
    assert out[1] is loose and out[2] is last  # untouched, in their places
    assert _records(out[0]) == _records(first) + _records(second)
    assert loose.lease.holders == 1 and last.lease.holders == 1
    for batch in out:
        batch.lease.release()
    assert releases.calls == Counter({1: 1, 2: 1, 3: 1, 4: 1})
    pool.close()


# -- the runtime ----------------------------------------------------------------


class EventSink:
    """Keeps every batch it gets (holding raw ones) and notes flushes, in order."""

    def __init__(self) -> None:
        self.events: list[object] = []
        self.capture = CaptureSink()

    async def submit(self, batch: Batch) -> None:
        await self.capture.submit(batch)
        self.events.append(batch)

    async def flush(self) -> None:
        self.events.append("flush")

    async def close(self) -> None:
        await self.capture.close()


def _runtime(pool: SharedBufferPool, raw: EventSink, rows: EventSink) -> RecordRuntime:
    config = RoutingConfig(
        [
            Route("raw", Q, "raw"),
            Route("norms", K, "rows", mode="stateless", processor="test.norms"),
        ]
    )
    sink = RoutingSink(config, SCHEMA, {"raw": raw, "rows": rows}, unmatched="drop")
    return RecordRuntime(sink, arena=pool)


def _raw_records(events: list[object]) -> list[tuple[int, int, bytes]]:
    return [r for e in events if isinstance(e, RecordBatch) for r in _records(e)]


def test_batches_of_one_wake_up_reach_each_route_merged_in_order_and_release_once():
    import tests.processors  # noqa: F401  (registers test.norms)

    pool = SharedBufferPool()
    releases = Releases()
    raw, rows = EventSink(), EventSink()
    runtime = _runtime(pool, raw, rows)
    q = runtime.bind_hook(Q, layout="vec")
    k = runtime.bind_hook(K, layout="vec")
    # Q and K alternate (two routes); queued before the loop runs, so its
    # first take finds all six: one wake-up.
    batches = [
        _pooled_batch(pool, q if key % 2 else k, key=key, records=key, releases=releases)
        for key in range(1, 7)
    ]
    expected_raw = [r for b in batches if b.descriptors["output_id"][0] == q for r in _records(b)]
    for batch in batches:
        runtime._ingress.put_batch(batch, defer_wake=True)
    with runtime.start():
        runtime.flush(timeout=HANG_GUARD_S)
        snapshot = runtime.snapshot()
    assert snapshot.ingress.merged == 6  # forced: all six were queued before the first take
    assert snapshot.ingress.batches == 6 and snapshot.ingress.submitted == 21
    raw_batches = [e for e in raw.events if isinstance(e, RecordBatch)]
    assert len(raw_batches) == 1  # one dispatch for the Q records of three submits
    assert _raw_records(raw.events) == expected_raw  # every record, its bytes, queue order
    norms = np.concatenate([e.rows for e in rows.events if isinstance(e, RowBatch)])
    assert list(norms["key"]) == [2, 2, 4, 4, 4, 4, 6, 6, 6, 6, 6, 6]
    assert list(norms["seq"]) == [20, 21, 40, 41, 42, 43, 60, 61, 62, 63, 64, 65]
    want = np.concatenate([np.linalg.norm(_vectors(n, n), axis=1) for n in (2, 4, 6)])
    np.testing.assert_allclose(norms["norm"], want, rtol=1e-6)
    # The raw destination still holds its (Q, odd) records' buffers; the K
    # buffers, processed into rows, went back.
    assert releases.calls == Counter({2: 1, 4: 1, 6: 1})
    raw.capture.clear()
    assert releases.calls == Counter(dict.fromkeys(range(1, 7), 1))
    pool.close()


def test_an_unspannable_batch_or_a_control_splits_the_merge_and_keeps_the_order():
    import tests.processors  # noqa: F401

    pool = SharedBufferPool()
    releases = Releases()
    raw, rows = EventSink(), EventSink()
    runtime = _runtime(pool, raw, rows)
    q = runtime.bind_hook(Q, layout="vec")
    queue = runtime._ingress
    queue.put_batch(_pooled_batch(pool, q, key=1, records=2, releases=releases), defer_wake=True)
    queue.put_batch(_pooled_batch(pool, q, key=2, records=1, releases=releases), defer_wake=True)
    loose = make_descriptors(
        q, RECORD, count=2, layout_ids=SCHEMA.layout_id("vec"), keys=3, seqs=[30, 31]
    )
    queue.put_batch(RecordBatch.from_buffer(loose, _vectors(2, 3).tobytes(), releases.of(3)))
    queue.put_batch(_pooled_batch(pool, q, key=4, records=1, releases=releases), defer_wake=True)
    flushed = queue.put_control("flush")
    queue.put_batch(_pooled_batch(pool, q, key=5, records=2, releases=releases), defer_wake=True)
    queue.put_batch(_pooled_batch(pool, q, key=6, records=1, releases=releases), defer_wake=True)
    with runtime.start():
        flushed.result(HANG_GUARD_S)
        runtime.flush(timeout=HANG_GUARD_S)
        snapshot = runtime.snapshot()
    keys = [
        "flush" if e == "flush" else list(e.descriptors["key"])  # type: ignore[union-attr]
        for e in raw.events
    ]
    # [1, 2] merged; 3 alone (not in the pool); 4 alone (the flush follows);
    # the flush between 4 and 5; [5, 6] merged; then the last flush and
    # close's.
    assert keys == [[1, 1, 2], [3, 3], [4], "flush", [5, 5, 6], "flush", "flush"]
    assert snapshot.ingress.merged == 4
    raw.capture.clear()
    assert releases.calls == Counter(dict.fromkeys(range(1, 7), 1))
    pool.close()


def test_without_an_arena_every_batch_goes_on_alone():
    pool = SharedBufferPool()
    releases = Releases()
    raw = EventSink()
    sink = RoutingSink(
        RoutingConfig([Route("raw", Q, "raw")]), SCHEMA, {"raw": raw}, unmatched="drop"
    )
    runtime = RecordRuntime(sink)
    q = runtime.bind_hook(Q, layout="vec")
    for key in (1, 2, 3):
        runtime._ingress.put_batch(
            _pooled_batch(pool, q, key=key, records=1, releases=releases), defer_wake=True
        )
    with runtime.start():
        runtime.flush(timeout=HANG_GUARD_S)
        assert runtime.snapshot().ingress.merged == 0
    assert [list(e.descriptors["key"]) for e in raw.events if e != "flush"] == [[1], [2], [3]]  # type: ignore[union-attr]
    raw.capture.clear()
    assert releases.calls == Counter({1: 1, 2: 1, 3: 1})
    pool.close()


def test_the_vec_layout_the_tests_use_is_four_float32():
    assert VEC.dtype.itemsize == RECORD


def test_merged_batches_cross_to_a_writer_process_by_reference_and_land_byte_exact(tmp_path):
    from taproute.routing import Layout, RecordSchema
    from taproute.service.sinks.writer import WriterProcessSink

    acts = Layout("acts", [("values", "Array(Float32)")])
    schema = RecordSchema([acts])
    sink = WriterProcessSink.embedded(schema, tmp_path / "data", raw=["acts"])
    pool = sink.buffer_pool
    releases = Releases()
    runtime = RecordRuntime(sink, arena=pool)
    hooks = [runtime.bind_hook(name, layout="acts") for name in ("h.0", "h.1")]
    expected: dict[tuple[int, int], list[float]] = {}
    for step in range(1, 9):  # 8 batches, 2 hooks, records of 3..5 floats
        widths = np.arange(3) + 3 + step % 2
        values = [np.arange(w, dtype=np.float32) + 10 * step + i for i, w in enumerate(widths)]
        flat = np.concatenate(values)
        buffer = pool.take_array(flat.nbytes)
        buffer[: flat.nbytes] = flat.view(np.uint8)
        release = releases.of(step)
        desc = make_descriptors(
            hooks[step % 2],
            widths * 4,
            layout_ids=schema.layout_id("acts"),
            keys=np.arange(3),
            steps=step,
        )
        runtime._ingress.put_batch(
            RecordBatch.from_buffer(
                desc,
                buffer[: flat.nbytes],
                lambda buffer=buffer, release=release: (pool.give_back(buffer), release()),
            ),
            defer_wake=True,
        )
        expected |= {(step, i): v.tolist() for i, v in enumerate(values)}
    with runtime.start():
        runtime.flush(timeout=HANG_GUARD_S)
        assert runtime.snapshot().ingress.merged == 8  # forced: queued before the first take
        rows = sink.query("SELECT step, key, hook, values FROM raw_acts").to_pylist()
        assert sink.counters.copied_bytes == 0  # crossed by reference, not copied
    assert {(r["step"], r["key"]): r["values"] for r in rows} == expected
    assert len(rows) == 24
    assert {r["hook"] for r in rows if r["step"] % 2} == {"h.1"}
    assert releases.calls == Counter(dict.fromkeys(range(1, 9), 1))


class FailingSink:
    """A record sink whose every submit raises (after noting what it got)."""

    def __init__(self) -> None:
        self.got: list[list[int]] = []

    async def submit(self, batch: Batch) -> None:
        self.got.append(list(batch.descriptors["key"]))  # type: ignore[union-attr]
        raise RuntimeError("destination refused")

    async def flush(self) -> None:
        pass

    async def close(self) -> None:
        pass


def test_a_sink_failure_on_a_merged_batch_is_latched_and_each_lease_goes_back_once():
    pool = SharedBufferPool()
    releases = Releases()
    sink = FailingSink()
    runtime = RecordRuntime(sink, arena=pool)
    q = runtime.bind_hook(Q, layout="vec")
    for key in (1, 2, 3):
        runtime._ingress.put_batch(
            _pooled_batch(pool, q, key=key, records=key, releases=releases), defer_wake=True
        )
    runtime.start()
    with pytest.raises(Exception, match="destination refused"):
        runtime.close(timeout=HANG_GUARD_S)
    assert sink.got == [[1, 2, 2, 3, 3, 3]]  # one merged submit, then nothing
    assert runtime.snapshot().failure is not None
    assert releases.calls == Counter({1: 1, 2: 1, 3: 1})
    pool.close()


class BrokenArena:
    """An arena whose spans() raises: the runtime must not depend on it."""

    def spans(self, payloads):
        raise RuntimeError("arena gone")


def test_an_arena_that_fails_leaves_every_batch_to_go_on_alone_in_order():
    pool = SharedBufferPool()
    releases = Releases()
    raw = EventSink()
    sink = RoutingSink(
        RoutingConfig([Route("raw", Q, "raw")]), SCHEMA, {"raw": raw}, unmatched="drop"
    )
    runtime = RecordRuntime(sink, arena=BrokenArena())
    q = runtime.bind_hook(Q, layout="vec")
    for key in (1, 2, 3):
        runtime._ingress.put_batch(
            _pooled_batch(pool, q, key=key, records=1, releases=releases), defer_wake=True
        )
    with runtime.start():
        runtime.flush(timeout=HANG_GUARD_S)
        snapshot = runtime.snapshot()
    assert snapshot.ingress.merged == 0 and snapshot.failure is None
    assert [list(e.descriptors["key"]) for e in raw.events if e != "flush"] == [[1], [2], [3]]  # type: ignore[union-attr]
    raw.capture.clear()
    assert releases.calls == Counter({1: 1, 2: 1, 3: 1})
    pool.close()


def test_merged_descriptors_are_the_batches_own_field_for_field():
    pool = SharedBufferPool()
    releases = Releases()
    batches = [_pooled_batch(pool, k, key=k, records=k + 2, releases=releases) for k in range(5)]
    (merged,), _ = merge(batches, pool)
    assert merged.descriptors.dtype == batches[0].descriptors.dtype
    want = np.concatenate([b.descriptors for b in batches])
    for field in want.dtype.names:
        if field != "offset":
            np.testing.assert_array_equal(merged.descriptors[field], want[field])
    pool.close()


# -- what a part of a merged batch holds (review of c1592f2) --------------------


class CountedReleases(Releases):
    """:class:`Releases` a test can wait on (an event, not a sleep)."""

    def __init__(self) -> None:
        super().__init__()
        self._changed = threading.Condition(self._lock)

    def of(self, key: int):
        def release() -> None:
            with self._changed:
                self.calls[key] += 1
                self._changed.notify_all()

        return release

    def wait_for(self, count: int, timeout: float) -> bool:
        """Whether ``count`` buffers went back within ``timeout`` (a hang guard)."""
        with self._changed:
            return self._changed.wait_for(lambda: len(self.calls) >= count, timeout)


def _one_mib_batches(pool: SharedBufferPool, releases: Releases) -> list[RecordBatch]:
    """Twelve batches of one 1 MiB record each in pool buffers (one per hook call)."""
    batches = []
    for k in range(12):
        buffer = pool.take_array(1 << 20)
        buffer[: 1 << 20] = k
        desc = make_descriptors(0, 1 << 20, count=1, keys=k, seqs=k)
        release = releases.of(k)
        batches.append(
            RecordBatch.from_buffer(
                desc,
                buffer[: 1 << 20],
                lambda buffer=buffer, release=release: (pool.give_back(buffer), release()),
            )
        )
    return batches


def test_a_part_of_a_merged_batch_holds_only_the_buffers_its_records_lie_in():
    pool = SharedBufferPool()
    releases = Releases()
    (merged,), _ = merge(_one_mib_batches(pool, releases), pool)
    parked = merged.select(np.array([3], dtype=np.intp)).retain()  # one record kept for a retry
    pair = merged.select(np.array([6, 5], dtype=np.intp))  # a route's part over two buffers
    pair_hold = pair.retain()
    single = pair.select(np.array([1], dtype=np.intp))  # record 5, a part of the part
    single_hold = single.retain()
    assert single.payload_of(0)[0] == 5 and pair.payload_of(0)[0] == 6
    merged.lease.release()  # the record worker and every other holder are done
    assert releases.calls == Counter(dict.fromkeys(set(range(12)) - {3, 5, 6}, 1))
    pair_hold.release()
    assert releases.calls[6] == 1 and releases.calls[5] == 0  # record 5 is still held
    single_hold.release()
    assert releases.calls[5] == 1 and releases.calls[3] == 0
    parked.release()
    assert releases.calls == Counter(dict.fromkeys(range(12), 1))  # each exactly once
    pool.close()


def test_a_part_acquired_after_one_of_its_buffers_went_back_takes_no_hold():
    released: list[int] = []
    leases = [BufferLease(lambda k=k: released.append(k)) for k in range(3)]
    merged = PartsLease.merged(leases)
    early = merged.over(np.array([0, 2], dtype=np.int32))
    late = merged.over(np.array([2, 1], dtype=np.int32))
    assert (early.buffers, late.buffers, late.holders) == (2, 2, 0)
    early.acquire()
    merged.release()  # buffer 1 goes back: only early's records are held
    assert released == [1]
    with pytest.raises(LeaseError):
        late.acquire()  # a bug: nobody held what it selected from
    early.release()
    assert sorted(released) == [0, 1, 2]  # late's failed acquire took no hold on 2
    with pytest.raises(IndexError, match="part 3 of a lease over 3 buffers"):
        merged.over(np.array([3], dtype=np.int32))
    with pytest.raises(TypeError, match="PartsLease.merged"):
        PartsLease()


def test_a_record_parked_for_a_retry_holds_only_its_own_buffer():
    """One record of twelve merged batches waits out a backoff: the other eleven
    buffers go back to the pool meanwhile (they held all twelve until it was done)."""
    from taproute.routing import FailurePolicy
    from tests.failing_processors import SCRIPT

    SCRIPT.reset()
    SCRIPT.failures_left[-2] = 1  # fail.connection_then_ok: one transient failure
    pool = SharedBufferPool()
    releases = CountedReleases()
    out = CaptureSink()
    route = Route(
        "r",
        "h.3",
        "out",
        mode="stateless",
        processor="fail.connection_then_ok",
        failure_policy=FailurePolicy(deadline=0, initial_backoff=3600.0),
    )
    sink = RoutingSink(RoutingConfig([route]), SCHEMA, {"out": out}, unmatched="drop")
    runtime = RecordRuntime(sink, arena=pool)
    hooks = [runtime.bind_hook(f"h.{k}", layout="vec") for k in range(12)]
    for k in range(12):  # queued before the loop runs: one wake-up, one merge
        runtime._ingress.put_batch(
            _pooled_batch(pool, hooks[k], key=k, records=1, releases=releases), defer_wake=True
        )
    runtime.start()
    try:
        runtime.flush(timeout=HANG_GUARD_S)
        snapshot = runtime.snapshot()
        assert snapshot.ingress.merged == 12
        assert snapshot.routes["r"].parked == 1  # waiting out its hour of backoff
        assert releases.calls == Counter(dict.fromkeys(set(range(12)) - {3}, 1))
    finally:
        runtime.close(timeout=HANG_GUARD_S)  # closing gives the parked record up
    assert releases.calls == Counter(dict.fromkeys(range(12), 1))
    pool.close()


def test_records_waiting_in_a_clickhouse_table_buffer_hold_only_their_own_buffers(
    chdb_transport,
):
    """A ClickHouse table buffer lingering for its insert keeps the buffers of
    its own records, not every buffer merged with them."""
    import uuid

    from taproute.service.sinks.clickhouse import Batching, ClickHouseSink

    table = f"merge_hold_{uuid.uuid4().hex[:8]}"
    ch = ClickHouseSink(
        chdb_transport,
        SCHEMA,
        raw=["vec"],
        create_tables=True,
        raw_table=table,
        batching=Batching(linger=3600.0),
        owns_transport=False,
    )
    pool = SharedBufferPool()
    releases = CountedReleases()
    sink = RoutingSink(
        RoutingConfig([Route("raw", "h.0", "ch")]), SCHEMA, {"ch": lambda: ch}, unmatched="drop"
    )
    runtime = RecordRuntime(sink, arena=pool)
    hooks = [runtime.bind_hook(f"h.{k}", layout="vec") for k in range(12)]
    for k in range(12):
        runtime._ingress.put_batch(
            _pooled_batch(pool, hooks[k], key=k, records=2, releases=releases), defer_wake=True
        )
    with runtime.start():
        # Eleven buffers come back once the record worker is done; h.0's
        # records wait in the table buffer (an hour's linger) meanwhile.
        assert releases.wait_for(11, timeout=20.0), f"given back: {sorted(releases.calls)}"
        assert runtime.snapshot().ingress.merged == 12
        assert releases.calls == Counter(dict.fromkeys(range(1, 12), 1))
        runtime.flush(timeout=HANG_GUARD_S)
        assert releases.calls == Counter(dict.fromkeys(range(12), 1))
        rows = ch.query(f"SELECT key, seq FROM {table} ORDER BY seq").to_pylist()
    assert rows == [{"key": 0, "seq": 0}, {"key": 0, "seq": 1}]
    assert releases.calls == Counter(dict.fromkeys(range(12), 1))
    pool.close()


def test_the_writer_counts_the_bytes_a_merged_batch_s_records_cover(tmp_path):
    """``shared_bytes`` is what crossed by reference: each route's records'
    bytes, not the merged view's span (size-class padding and the other
    routes' buffers between them), once per route."""
    from taproute.service.sinks.writer import WriterProcessSink

    writer = WriterProcessSink.embedded(SCHEMA, tmp_path / "data", raw=["vec"])
    pool = writer.buffer_pool
    releases = Releases()
    config = RoutingConfig([Route("even", "h.even", "w"), Route("odd", "h.odd", "w")])
    runtime = RecordRuntime(
        RoutingSink(config, SCHEMA, {"w": lambda: writer}, unmatched="drop"), arena=pool
    )
    hooks = [runtime.bind_hook(name, layout="vec") for name in ("h.even", "h.odd")]
    records = 0
    for k in range(8):  # 16 to 128 bytes each, in 4 KiB pool buffers
        runtime._ingress.put_batch(
            _pooled_batch(pool, hooks[k % 2], key=k, records=k + 1, releases=releases),
            defer_wake=True,
        )
        records += k + 1
    with runtime.start():
        runtime.flush(timeout=HANG_GUARD_S)
        assert runtime.snapshot().ingress.merged == 8
        assert writer.query("SELECT count() AS n FROM raw_vec").to_pylist() == [{"n": records}]
        assert writer.counters.copied_bytes == 0
        assert writer.counters.shared_bytes == records * RECORD
    assert releases.calls == Counter(dict.fromkeys(range(8), 1))


async def test_a_chained_part_of_a_merged_batch_refused_by_the_causal_limits_goes_back_once():
    """Forward records derived from a merged batch keep its parts; a part the
    causal limits refuse (its payload kept for the dead letter) has a lease
    of its own that nobody acquired: the refusal must not release it (only
    a redacted copy's lease is the refusal's to release)."""
    from taproute.actors import open_routing_sink
    from taproute.routing import HookRegistry, RecordFailure
    from taproute.routing.causal import CausalLimits

    pool = SharedBufferPool()
    releases = Releases()
    hooks = HookRegistry()
    q, k = hooks.bind(Q, layout="vec"), hooks.bind(K, layout="vec")
    raw = CaptureSink()
    config = RoutingConfig(
        [
            Route("a", Q, "raw", then=("b",)),
            Route("b", "route:a", "raw", then=("c",)),
            Route("c", "route:b", "raw"),  # depth 2: refused
        ],
        causal_limits=CausalLimits(max_depth=1, redact_payload=False),
    )
    failures: list[RecordFailure] = []

    def keep(failure: RecordFailure) -> None:
        failures.append(failure)
        assert failure.records.payload_of(0).nbytes == RECORD  # the payload, not redacted

    batches = [
        _pooled_batch(pool, q if key % 2 else k, key=key, records=2, releases=releases)
        for key in range(1, 5)
    ]
    (merged,), _ = merge(batches, pool)
    async with open_routing_sink(
        config, SCHEMA, {"raw": raw}, unmatched="drop", hooks=hooks, on_failure=keep
    ) as sink:
        await sink.submit(merged)
        merged.lease.release()  # the submitter is done
        await sink.flush()
        snap = sink.snapshot()
        assert releases.calls == Counter({2: 1, 4: 1})  # K's records: dropped, given back
    assert snap.causal.refused_depth == 4 and snap.failure is None
    assert [len(f.records) for f in failures] == [4]
    assert sorted(int(key) for b in raw.record_batches for key in b.descriptors["key"]) == [
        1,
        1,
        1,
        1,
        3,
        3,
        3,
        3,
    ]
    raw.clear()
    assert releases.calls == Counter({1: 1, 2: 1, 3: 1, 4: 1})
    pool.close()
