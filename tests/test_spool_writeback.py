"""The spool starts the writeback of what it appends as it goes (so an fsync
finds little left to write), over every byte once, segment by segment, and
changes nothing in the files."""

from __future__ import annotations

import os

import numpy as np

from taproute.routing import RecordBatch
from taproute.service.sinks.spool import Spool, SpoolConfig
from taproute.service.sinks.spool import files as spool_files
from taproute.service.sinks.spool import log as spool_log
from tests.conftest import vec_batch


async def test_writeback_is_started_over_every_appended_byte_once_per_segment(
    tmp_path, monkeypatch
):
    started: list[tuple[int, int, int, int]] = []  # (inode, offset, bytes, file size then)

    def spy(fd: int, offset: int, nbytes: int) -> None:
        stat = os.fstat(fd)
        started.append((stat.st_ino, offset, nbytes, stat.st_size))
        spool_files.start_writeback(fd, offset, nbytes)  # the real call, on the real file

    monkeypatch.setattr(spool_log, "start_writeback", spy)
    config = SpoolConfig(directory=tmp_path / "s", segment_bytes=3 << 20)
    spool = Spool.open(config)
    sent = [vec_batch(1, 10_000, seq_start=10_000 * i) for i in range(12)]  # ~0.6 MiB each
    for b in sent:
        assert await spool.append(b) == "spooled"
    segments = spool.snapshot().segments
    await spool.aclose()

    assert segments >= 2
    by_segment: dict[int, list[tuple[int, int, int]]] = {}
    for inode, offset, nbytes, size in started:
        by_segment.setdefault(inode, []).append((offset, nbytes, size))
    assert len(by_segment) >= 2  # each new segment starts its own ranges
    for ranges in by_segment.values():
        at = 0
        for offset, nbytes, size in ranges:
            assert offset == at  # contiguous: no byte twice, none skipped
            assert nbytes >= spool_log.WRITEBACK_BYTES  # never a syscall per small frame
            assert offset + nbytes == size  # up to everything appended so far
            at += nbytes

    again = Spool.open(config)  # the files are what they were: every frame reads back
    assert again.damage == []
    got: list[RecordBatch] = []
    while (entry := again.first()) is not None:
        frame = await again.read(entry)
        got.extend(b for b in frame.batches if isinstance(b, RecordBatch))
        await again.ack(frame.seq)
    await again.aclose()
    assert len(got) == len(sent)
    for want, have in zip(sent, got, strict=True):
        np.testing.assert_array_equal(have.descriptors, want.descriptors)
        np.testing.assert_array_equal(np.asarray(have.payload), np.asarray(want.payload))


def test_start_writeback_leaves_the_file_as_written(tmp_path):
    path = tmp_path / "f"
    data = os.urandom(3 << 20)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
        spool_files.start_writeback(fd, 0, len(data))
        spool_files.start_writeback(fd, 1 << 20, 1 << 30)  # past the end: harmless
    finally:
        os.close(fd)
    assert path.read_bytes() == data


def test_start_writeback_degrades_to_nothing_where_sync_file_range_is_missing(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(spool_files.sys, "platform", "darwin")
    assert spool_files._sync_file_range() is None  # not looked up off Linux
    monkeypatch.setattr(spool_files, "_SYNC_RANGE", None)
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"x" * 4096)
        spool_files.start_writeback(fd, 0, 4096)  # a no-op, not an error
    finally:
        os.close(fd)
    assert path.read_bytes() == b"x" * 4096


def test_start_writeback_ignores_a_descriptor_it_cannot_start():
    read, write = os.pipe()  # sync_file_range on a pipe fails (ESPIPE): the fsync reports errors
    try:
        spool_files.start_writeback(write, 0, 1 << 20)
    finally:
        os.close(read)
        os.close(write)
