"""The spool itself: frames on disk, order, acknowledgement, damage, quota."""

from __future__ import annotations

import numpy as np
import pytest
import trio

from taproute.native import DESCRIPTOR_DTYPE
from taproute.routing import RecordBatch, RowBatch
from taproute.service.sinks.spool import Spool, SpoolConfig, SpoolFull
from taproute.service.sinks.spool.log import HEADER
from tests.conftest import vec_batch


def values(batch: RecordBatch) -> np.ndarray:
    return np.concatenate([batch.payload_of(i).view(np.float32) for i in range(len(batch))])


async def drain(spool: Spool) -> list[RecordBatch]:
    out = []
    while (entry := spool.first()) is not None:
        got = await spool.read(entry)
        assert all(isinstance(b, RecordBatch) for b in got.batches)
        out.extend(got.batches)
        await spool.ack(got.seq)
    return out


async def test_batches_come_back_in_order_byte_for_byte_after_reopen(tmp_path):
    config = SpoolConfig(directory=tmp_path / "db", segment_bytes=600)
    spool = Spool.open(config)
    sent = [vec_batch(1, 5, seq_start=10 * i) for i in range(6)]
    for b in sent:
        assert await spool.append(b) == "spooled"
    assert spool.snapshot().segments > 1  # rolled over at segment_bytes
    await spool.aclose()

    again = Spool.open(config)
    assert again.damage == []
    got = await drain(again)
    assert len(got) == 6
    for want, have in zip(sent, got, strict=True):
        np.testing.assert_array_equal(have.descriptors, want.descriptors)
        np.testing.assert_array_equal(values(have), values(want))
    assert again.snapshot().bytes == 0
    assert again.snapshot().segments <= 1  # delivered segments deleted (the active one stays)


async def test_acknowledged_frames_are_not_replayed_and_tokens_stay_unique(tmp_path):
    config = SpoolConfig(directory=tmp_path / "d", segment_bytes=10_000)
    spool = Spool.open(config)
    for i in range(4):
        await spool.append(vec_batch(1, 3, seq_start=i))
    first = spool.first()
    assert first is not None
    await spool.ack(first.seq + 1)  # two delivered
    tokens = {spool.token(e.seq) for e in list(spool._log.entries)}
    await spool.aclose()

    again = Spool.open(config)
    assert len(again) == 2
    entry = again.first()
    assert entry is not None and entry.seq == first.seq + 2
    assert again.token(entry.seq) in tokens
    # Everything delivered and deleted: a new append still gets a new position.
    await drain(again)
    await again.append(vec_batch(1, 1))
    newest = again.first()
    assert newest is not None and newest.seq == first.seq + 4
    await again.aclose()


async def test_a_selection_is_stored_compactly_and_reads_back_the_selected_records(tmp_path):
    spool = Spool.open(SpoolConfig(directory=tmp_path))
    whole = vec_batch(1, 10)
    part = whole.select(np.array([7, 2, 9]))
    await spool.append(part)
    entry = spool.first()
    assert entry is not None
    # header, head, three descriptors, and only the three records' payloads
    assert entry.size == HEADER.size + 2 + 4 + 8 + 9 + 3 * DESCRIPTOR_DTYPE.itemsize + 3 * 16
    (got,) = (await spool.read(entry)).batches
    assert isinstance(got, RecordBatch)
    np.testing.assert_array_equal(values(got), values(part))
    np.testing.assert_array_equal(got.descriptors["seq"], [7, 2, 9])
    await spool.aclose()


async def test_row_batches_with_string_columns_round_trip(tmp_path):
    spool = Spool.open(SpoolConfig(directory=tmp_path))
    rows = np.array([(1, "a"), (2, "bb")], dtype=[("n", "<u4"), ("s", object)])
    await spool.append(RowBatch(route="r", layout_name="out", rows=rows))
    entry = spool.first()
    assert entry is not None
    (got,) = (await spool.read(entry)).batches
    assert isinstance(got, RowBatch)
    assert (got.route, got.layout_name) == ("r", "out")
    assert got.rows.tolist() == rows.tolist()
    await spool.aclose()


async def test_a_torn_last_frame_is_truncated_reported_and_never_replayed(tmp_path):
    config = SpoolConfig(directory=tmp_path)
    spool = Spool.open(config)
    for i in range(3):
        await spool.append(vec_batch(1, 4, seq_start=i))
    await spool.aclose()
    (segment,) = tmp_path.glob("*.seg")
    whole = segment.stat().st_size
    with open(segment, "r+b") as f:  # killed half-way through the third frame
        f.truncate(whole - 30)

    again = Spool.open(config)
    (damage,) = again.damage
    assert damage.segment == segment.name and "past the end" in damage.reason
    assert segment.stat().st_size == damage.offset  # truncated to the last good frame
    assert again.snapshot().damaged_bytes == whole - 30 - damage.offset
    got = await drain(again)
    assert [int(b.descriptors["seq"][0]) for b in got] == [0, 1]
    # Appending after the truncation continues cleanly, and a reopen is clean.
    await again.append(vec_batch(1, 1, seq_start=99))
    await again.aclose()
    third = Spool.open(config)
    assert third.damage == []
    assert [int(b.descriptors["seq"][0]) for b in await drain(third)] == [99]
    await third.aclose()


async def test_a_corrupt_frame_ends_its_segment_but_later_segments_still_replay(tmp_path):
    config = SpoolConfig(directory=tmp_path, segment_bytes=1)  # one frame per segment
    spool = Spool.open(config)
    for i in range(3):
        await spool.append(vec_batch(1, 2, seq_start=i))
    await spool.aclose()
    middle = sorted(tmp_path.glob("*.seg"))[1]
    data = bytearray(middle.read_bytes())
    data[HEADER.size + 60] ^= 0xFF  # a flipped bit in the payload
    middle.write_bytes(bytes(data))

    again = Spool.open(config)
    (damage,) = again.damage
    assert damage.segment == middle.name and damage.reason == "checksum mismatch"
    assert "never replayed" in str(damage)
    got = await drain(again)
    assert [int(b.descriptors["seq"][0]) for b in got] == [0, 2]
    await again.aclose()


async def test_garbage_and_a_damaged_ack_file_never_crash_opening(tmp_path):
    config = SpoolConfig(directory=tmp_path)
    spool = Spool.open(config)
    await spool.append(vec_batch(1, 2))
    await spool.ack(1)
    await spool.append(vec_batch(1, 2, seq_start=5))
    await spool.aclose()
    (tmp_path / "00000000000000000077.seg").write_bytes(
        b"not a frame at all, and long enough for a header"
    )
    (tmp_path / "ack").write_bytes(b"xx")

    again = Spool.open(config)
    reasons = sorted(d.reason for d in again.damage)
    assert reasons == ["acknowledged position unreadable", "bad frame magic"]
    # Without a readable ack, everything on disk replays (dedup tokens make
    # the repeat harmless): nothing acknowledged-or-not is skipped.
    got = await drain(again)
    assert [int(b.descriptors["seq"][0]) for b in got] == [0, 5]
    await again.aclose()


async def test_quota_drop_newest_counts_what_it_drops(tmp_path):
    one = vec_batch(1, 4)
    spool = Spool.open(SpoolConfig(directory=tmp_path, quota_bytes=1000, when_full="drop_newest"))
    outcomes = [await spool.append(vec_batch(1, 4, seq_start=i)) for i in range(5)]
    kept = outcomes.count("spooled")
    assert 1 <= kept < 5 and outcomes[kept:] == ["dropped"] * (5 - kept)
    counters = spool.snapshot()
    assert counters.dropped_batches == 5 - kept
    assert counters.dropped_records == (5 - kept) * len(one)
    assert counters.appended_records + counters.dropped_records == 20
    assert counters.bytes <= 1000
    await spool.aclose()


async def test_quota_dead_letter_hands_the_batch_over_and_counts_it(tmp_path):
    shed: list[tuple[int, str]] = []

    async def dead_letter(batch, reason):
        shed.append((int(batch.descriptors["seq"][0]), reason))

    spool = Spool.open(
        SpoolConfig(directory=tmp_path, quota_bytes=1000, when_full="dead_letter"),
        dead_letter=dead_letter,
    )
    outcomes = [await spool.append(vec_batch(1, 4, seq_start=i)) for i in range(5)]
    kept = outcomes.count("spooled")
    assert shed == [(i, "spool_full") for i in range(kept, 5)]
    assert spool.snapshot().dead_lettered_records == 4 * (5 - kept)
    await spool.aclose()


async def test_quota_block_waits_for_an_ack_then_times_out_when_none_comes(
    tmp_path, autojump_clock
):
    spool = Spool.open(
        SpoolConfig(directory=tmp_path, quota_bytes=1000, when_full="block", block_timeout=5.0)
    )
    while spool.unacked_bytes + 343 <= 1000:
        await spool.append(vec_batch(1, 4))
    results: list[str] = []

    async def producer():
        results.append(await spool.append(vec_batch(1, 4, seq_start=50)))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(producer)
        await trio.sleep(1.0)
        assert results == []  # blocked: the spool is full
        entry = spool.first()
        assert entry is not None
        await spool.ack(spool._log.last_seq)  # the destination caught up
    assert results == ["spooled"]
    assert spool.snapshot().blocked_seconds == pytest.approx(1.0)

    while spool.unacked_bytes + 343 <= 1000:
        await spool.append(vec_batch(1, 4))
    before = trio.current_time()
    with pytest.raises(SpoolFull, match="when_full='block'"):
        await spool.append(vec_batch(1, 4))
    assert trio.current_time() - before == pytest.approx(5.0)
    # Per stall, not per batch: until something is acknowledged, the next
    # ones shed at once (each waited its own 5 s: a queue of N batches took
    # N x 5 s to shed)...
    before = trio.current_time()
    for _ in range(3):
        with pytest.raises(SpoolFull, match="when_full='block'"):
            await spool.append(vec_batch(1, 4))
    assert trio.current_time() == before
    # ... and once an acknowledgement made room, a full spool waits again.
    await spool.ack(spool._log.entries[0].seq)
    while spool.unacked_bytes + 343 <= 1000:
        await spool.append(vec_batch(1, 4))
    before = trio.current_time()
    with pytest.raises(SpoolFull, match="when_full='block'"):
        await spool.append(vec_batch(1, 4))
    assert trio.current_time() - before == pytest.approx(5.0)
    await spool.aclose()


def test_bad_config_names_the_field_and_the_choices(tmp_path):
    from taproute.routing.errors import ConfigError

    with pytest.raises(ConfigError, match="when_full: expected one of block, drop_newest"):
        SpoolConfig(directory=tmp_path, when_full="drop_oldest")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="dead-letter store"):
        Spool.open(SpoolConfig(directory=tmp_path, when_full="dead_letter"))


async def test_fsync_policies_sync_when_they_say(tmp_path, autojump_clock, monkeypatch):
    synced: list[str] = []
    for policy in ("batch", "interval", "flush"):
        spool = Spool.open(
            SpoolConfig(directory=tmp_path / policy, fsync=policy, fsync_interval=10.0),
            clock=trio.current_time,
        )
        real = spool._log.sync
        monkeypatch.setattr(
            spool._log, "sync", lambda real=real, p=policy: (synced.append(p), real())
        )
        for _ in range(3):
            await spool.append(vec_batch(1, 1))
            await trio.sleep(6.0)
        await spool.sync()  # what a flush does
        await spool.aclose()
    # Each also syncs once at close; a flush with nothing new since the last
    # sync skips it.  batch: every append; interval (10 s, appends 6 s apart):
    # once, at the third append; flush: at the flush.
    assert synced.count("batch") == 3 + 1
    assert synced.count("interval") == 1 + 1
    assert synced.count("flush") == 1 + 1


async def test_snapshot_reports_oldest_unacked_age(tmp_path, autojump_clock):
    spool = Spool.open(SpoolConfig(directory=tmp_path), clock=trio.current_time)
    await spool.append(vec_batch(1, 2))
    await trio.sleep(30)
    await spool.append(vec_batch(1, 2))
    snap = spool.snapshot()
    assert snap.frames == 2 and snap.segments == 1 and snap.bytes > 0
    assert snap.oldest_unacked_age_s == pytest.approx(30)
    await spool.ack(1)
    assert spool.snapshot().oldest_unacked_age_s == pytest.approx(0)
    await spool.aclose()


async def test_a_spool_directory_has_one_writer_at_a_time(tmp_path):
    from taproute.service.sinks.spool.log import SpoolLocked

    first = Spool.open(SpoolConfig(directory=tmp_path))
    with pytest.raises(SpoolLocked, match="in use by another sink or process"):
        Spool.open(SpoolConfig(directory=tmp_path))
    await first.aclose()
    Spool.open(SpoolConfig(directory=tmp_path))  # free again once closed


async def test_a_group_in_flight_at_a_crash_is_the_first_group_again_under_its_token(tmp_path):
    config = SpoolConfig(directory=tmp_path)
    spool = Spool.open(config)
    for i in range(5):
        await spool.append(vec_batch(1, 2, seq_start=2 * i))
    group = await spool.read_group(1 << 20)
    assert (group.first, group.seq, group.records) == (1, 5, 10)
    assert group.token == f"spool-{spool.spool_id}-1-5"
    await spool.aclose()  # killed before the ack: the insert may have happened

    again = Spool.open(config)
    for i in range(5, 8):
        await again.append(vec_batch(1, 2, seq_start=2 * i))
    replay = await again.read_group(1 << 20)  # more frames now, same group
    assert (replay.first, replay.seq, replay.token) == (1, 5, group.token)
    await again.ack(replay.seq)
    rest = await again.read_group(1 << 20)
    assert (rest.first, rest.seq) == (6, 8)
    await again.aclose()


async def test_a_single_frame_in_flight_at_a_crash_is_again_tried_alone(tmp_path):
    config = SpoolConfig(directory=tmp_path)
    spool = Spool.open(config)
    for i in range(3):
        await spool.append(vec_batch(1, 2, seq_start=2 * i))
    alone = await spool.read_group(1)  # a byte limit below one frame: one frame
    assert (alone.first, alone.seq, alone.token) == (1, 1, spool.token(1))
    await spool.aclose()

    again = Spool.open(config)
    replay = await again.read_group(1 << 20)
    assert (replay.first, replay.seq, replay.token) == (1, 1, alone.token)
    await again.ack(1)
    rest = await again.read_group(1 << 20)  # acknowledged: grouping is free again
    assert (rest.first, rest.seq) == (2, 3)
    await again.aclose()


async def test_a_frame_with_its_own_token_is_inserted_alone(tmp_path):
    spool = Spool.open(SpoolConfig(directory=tmp_path))
    await spool.append(vec_batch(1, 2))
    await spool.append(vec_batch(1, 2, seq_start=2), token="mem-abc-7")
    await spool.append(vec_batch(1, 2, seq_start=4))
    before = await spool.read_group(1 << 20)
    assert (before.first, before.seq) == (1, 1)  # the group ends before it
    await spool.ack(1)
    fixed = await spool.read_group(1 << 20)
    assert (fixed.first, fixed.seq, fixed.token) == (2, 2, "mem-abc-7")
    await spool.ack(2)
    after = await spool.read_group(1 << 20)
    assert (after.first, after.seq, after.token) == (3, 3, spool.token(3))
    await spool.aclose()


async def test_an_append_waits_while_a_groups_intent_is_being_written(tmp_path, monkeypatch):
    # The intent fsyncs the active segment in a worker thread; an append that
    # rolled or retired that segment meanwhile closed the descriptor under it
    # (EBADF in the spool bench).  Writes wait for the intent instead.
    import threading

    spool = Spool.open(SpoolConfig(directory=tmp_path, segment_bytes=1))  # every append rolls
    await spool.append(vec_batch(1, 2))
    started, release = threading.Event(), threading.Event()
    real = spool._log.intend
    order: list[str] = []

    def slow_intend(first: int, last: int) -> None:
        order.append("intend started")
        started.set()
        release.wait(10)
        real(first, last)
        order.append("intend done")

    monkeypatch.setattr(spool._log, "intend", slow_intend)

    async def write() -> None:
        await spool.append(vec_batch(1, 2, seq_start=2))
        order.append("appended")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(spool.read_group, 1 << 20)
        await trio.to_thread.run_sync(started.wait, 10)
        nursery.start_soon(write)
        await trio.testing.wait_all_tasks_blocked()
        assert order == ["intend started"]  # the append is waiting, not rolling
        release.set()
    assert order == ["intend started", "intend done", "appended"]
    assert spool.snapshot().frames == 2
    await spool.aclose()


class HeldRead:
    """``spool``'s group reads wait in their worker thread for ``release``
    (after ``started``); ``order`` logs reads starting and ending and the
    log's close."""

    def __init__(self, spool: Spool, monkeypatch, *, open_reader_first: bool = False) -> None:
        import threading

        self.started, self.release = threading.Event(), threading.Event()
        self.order: list[str] = []
        real_read, real_close = spool._log.read_many, spool._log.close

        def slow_read(entries):
            if open_reader_first:
                real_read(entries)  # the segment's reader is open now
            self.order.append("read started")
            self.started.set()
            self.release.wait(10)
            bodies = real_read(entries)  # through that reader again
            self.order.append("read done")
            return bodies

        def close() -> None:
            self.order.append("close")
            real_close()

        monkeypatch.setattr(spool._log, "read_many", slow_read)
        monkeypatch.setattr(spool._log, "close", close)


async def test_closing_waits_for_a_group_being_read_in_a_thread(tmp_path, monkeypatch):
    # A spooling sink closes its spool right after stopping the drain, whose
    # read of a group may still run in its worker thread (a read is not
    # abandoned: its task waits for it).  Closing under it closed the readers'
    # descriptors the read was using (EBADF) and released the directory's lock
    # while the read reopened one.  Closing waits for the read instead.

    spool = Spool.open(SpoolConfig(directory=tmp_path))
    await spool.append(vec_batch(1, 2))
    held = HeldRead(spool, monkeypatch, open_reader_first=True)
    started, release, order = held.started, held.release, held.order
    threads = trio.to_thread.current_default_thread_limiter()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(spool.read_group, 1 << 20)
        await trio.to_thread.run_sync(started.wait, 10)
        nursery.start_soon(spool.aclose)
        await trio.testing.wait_all_tasks_blocked()
        # The close is waiting on the loop: it has not gone to a thread of its own.
        assert order == ["read started"]
        assert threads.statistics().borrowed_tokens == 1  # the read's alone
        release.set()
    assert order == ["read started", "read done", "close"]
    assert spool._log._readers == {}  # every descriptor closed with the spool


async def test_a_group_is_chosen_once_an_append_in_a_thread_is_done(tmp_path, monkeypatch):
    # An append that rolls the segment (or writes a large frame) runs in a
    # worker thread and adds its entry to the log's deque there; read_group
    # iterated that deque on the loop meanwhile ("deque mutated during
    # iteration" when the thread got the GIL mid-scan).  The group is chosen
    # under the writers' lock instead, so it waits for the append.
    import threading

    spool = Spool.open(SpoolConfig(directory=tmp_path, segment_bytes=1))  # every append rolls
    await spool.append(vec_batch(1, 2))
    started, release = threading.Event(), threading.Event()
    real_append, real_read = spool._log.append, spool._log.read_many
    order: list[str] = []

    def slow_append(buffers, written_ns):
        order.append("append started")
        started.set()
        release.wait(10)
        entry = real_append(buffers, written_ns)
        order.append("append done")
        return entry

    def read_many(entries):
        order.append("read")
        return real_read(entries)

    monkeypatch.setattr(spool._log, "append", slow_append)
    monkeypatch.setattr(spool._log, "read_many", read_many)
    threads = trio.to_thread.current_default_thread_limiter()
    groups = []

    async def read_group() -> None:
        groups.append(await spool.read_group(1 << 20))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(spool.append, vec_batch(1, 2, seq_start=2))
        await trio.to_thread.run_sync(started.wait, 10)
        nursery.start_soon(read_group)
        await trio.testing.wait_all_tasks_blocked()
        assert order == ["append started"]
        assert threads.statistics().borrowed_tokens == 1  # the append's alone
        release.set()
    assert order == ["append started", "append done", "read"]
    (group,) = groups
    assert (group.first, group.seq) == (1, 2)  # the frame appended meanwhile is in it
    await spool.aclose()


async def test_closing_a_spooling_sink_waits_for_its_drains_read(tmp_path, monkeypatch):
    # The path the spool's read race took: close() stops the drain (cancelled,
    # its read's thread runs on) and closes the spool without waiting for the
    # drain's task.  The spool's files are closed only once the read is done.

    from taproute.service.sinks.spool.spooling import SpoolingSink

    class Inner:
        records = 0

        async def submit(self, batch) -> None:
            self.records += len(batch)

        async def flush(self) -> None:
            pass

        async def close(self) -> None:
            pass

    spool = Spool.open(SpoolConfig(directory=tmp_path))
    spooling = SpoolingSink("d", Inner(), spool, mode="always", drain_on_close=0.0)
    held = HeldRead(spool, monkeypatch)
    started, release, order = held.started, held.release, held.order
    threads = trio.to_thread.current_default_thread_limiter()
    async with trio.open_nursery() as nursery:
        await nursery.start(spooling.run)
        await spooling.submit(vec_batch(1, 2))
        await spool.sync()  # so close()'s own flush makes no thread trip
        await trio.to_thread.run_sync(started.wait, 10)
        nursery.start_soon(spooling.close)
        await trio.testing.wait_all_tasks_blocked()
        assert order == ["read started"]
        assert threads.statistics().borrowed_tokens == 1  # the read's alone
        release.set()
    assert order == ["read started", "read done", "close"]
    assert spool._log._readers == {}
