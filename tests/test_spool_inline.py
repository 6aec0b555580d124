"""Where a spool writes a frame: small and mid-size frames on the loop while
writes are fast, in a worker thread after a slow write (until one is fast
there again), for a frame over the inline size, and for a frame that closes
a full segment (its fsync); every frame reads back the same wherever it was
written."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np

from taproute.routing import RecordBatch
from taproute.service.sinks.spool import Spool, SpoolConfig
from taproute.service.sinks.spool import spool as spool_module
from taproute.service.sinks.spool.codec import encode
from tests.conftest import vec_batch


class Spy:
    """Wraps a spool's segment log: which thread wrote each frame."""

    def __init__(self, spool: Spool) -> None:
        self.on_loop: list[bool] = []
        log = spool._log
        append = log.append
        loop_thread = threading.get_ident()

        def spy(buffers, written_ns):
            self.on_loop.append(threading.get_ident() == loop_thread)
            return append(buffers, written_ns)

        log.append = spy  # type: ignore[method-assign]


def durations(*seconds: float) -> Iterator[float]:
    """A timer whose successive (start, end) pairs are ``seconds`` apart."""
    now = 0.0
    for s in seconds:
        yield now
        now += s
        yield now


def frame_bytes(batch: RecordBatch) -> int:
    return sum(memoryview(b).nbytes for b in encode([batch], None))


async def read_all(config: SpoolConfig) -> list[RecordBatch]:
    again = Spool.open(config)
    assert again.damage == []
    got: list[RecordBatch] = []
    while (entry := again.first()) is not None:
        frame = await again.read(entry)
        got.extend(b for b in frame.batches if isinstance(b, RecordBatch))
        await again.ack(frame.seq)
    await again.aclose()
    return got


async def test_mid_size_frames_go_to_a_thread_after_a_slow_write_until_one_is_fast(tmp_path):
    config = SpoolConfig(directory=tmp_path / "s")
    spool = Spool.open(config)
    spy = Spy(spool)
    slow = spool_module._SLOW_WRITE_S * 2
    fast = spool_module._SLOW_WRITE_S / 4
    timer = durations(fast, slow, slow, fast, fast)
    spool._timer = lambda: next(timer)
    small = vec_batch(1, 100)  # ~6 KB: always on the loop, and not timed
    assert frame_bytes(small) <= spool_module._SMALL_BYTES
    mid = [vec_batch(1, 20_000, seq_start=20_000 * i) for i in range(5)]  # ~1.3 MB frames
    assert spool_module._SMALL_BYTES < frame_bytes(mid[0]) < spool_module._INLINE_BYTES
    sent = [mid[0], mid[1], mid[2], small, mid[3], mid[4]]
    for b in sent:
        assert await spool.append(b) == "spooled"
    await spool.aclose()
    # fast on the loop; slow on the loop; slow in a thread; small on the loop
    # whatever; fast in a thread; back on the loop
    assert spy.on_loop == [True, True, False, True, False, True]
    assert next(timer, None) is None  # every mid-size frame was timed, the small one not
    got = await read_all(config)
    assert len(got) == len(sent)
    for want, have in zip(sent, got, strict=True):
        np.testing.assert_array_equal(have.descriptors, want.descriptors)
        np.testing.assert_array_equal(np.asarray(have.payload), np.asarray(want.payload))


async def test_large_frames_and_segment_rolls_are_written_in_a_thread(tmp_path):
    config = SpoolConfig(directory=tmp_path / "s", segment_bytes=1 << 20)
    spool = Spool.open(config)
    spy = Spy(spool)
    large = vec_batch(1, 40_000)  # a ~2.6 MB frame
    assert frame_bytes(large) > spool_module._INLINE_BYTES
    small = [vec_batch(1, 100, seq_start=100 * i) for i in range(3)]
    sent = [small[0], large, small[1], small[2]]
    for b in sent:
        assert await spool.append(b) == "spooled"
    segments = spool.snapshot().segments
    await spool.aclose()
    # the first segment's first frame on the loop; the large one in a thread;
    # the next small one closes the (now full) segment: a thread; then the loop
    assert spy.on_loop == [True, False, False, True]
    assert segments == 2
    got = await read_all(config)
    assert [len(b) for b in got] == [len(b) for b in sent]
