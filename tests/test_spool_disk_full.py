"""A spool on a file system with no room left: the quota policy, never an error.

A real refusal from the kernel, without root: each scenario runs in a child
process whose file-size limit (``RLIMIT_FSIZE``, SIGXFSZ ignored) makes a
segment's write past the limit fail with ``EFBIG``, as a full disk fails
with ``ENOSPC`` (both are "no room": :data:`taproute.service.sinks.spool.log.NO_ROOM`).
Before the fix, the ``OSError`` left ``Spool.append`` and latched the
destination's failure: the router stopped (seen with a spool on a full
tmpfs under ``taproute run``: ``RoutingFailure ... No space left on device``).
"""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from taproute.service import DeadLetterStore
from taproute.service.sinks.spool import Spool, SpoolConfig
from taproute.service.sinks.spool.dead_letters import destination_dead_letters
from tests.conftest import vec_batch

#: Each file may hold this many bytes: a segment about 150 frames of 20
#: records (the spool's 64 KiB reserve file fits).
LIMIT = 256 << 10

SCENARIO = textwrap.dedent(
    """
    import json, sys
    import trio, trio.testing
    from taproute.service.sinks.spool import Spool, SpoolConfig, SpoolFull
    from tests.conftest import vec_batch

    directory, scenario = sys.argv[1], sys.argv[2]
    when_full = "block" if scenario == "ack" else scenario
    timeout = None if sys.argv[3] == "none" else float(sys.argv[3])
    out = {}

    async def fill(spool):
        # Append until the file system refuses a frame (the policy's outcome).
        for i in range(10_000):
            outcome = await spool.append(vec_batch(1, 20, seq_start=i))
            if outcome != "spooled":
                return i, outcome
        raise AssertionError("the file-size limit never refused a frame")

    async def main():
        config = SpoolConfig(
            directory=directory, when_full=when_full, block_timeout=timeout,
            segment_bytes=1 << 20, quota_bytes=1 << 30,
        )
        spool = Spool.open(config, dead_letter=None)
        if when_full == "drop_newest":
            spooled, outcome = await fill(spool)
            out["spooled"], out["outcome"] = spooled, outcome
            out["dropped_records"] = spool.snapshot().dropped_records
            out["disk_full_errors"] = spool.snapshot().disk_full_errors
            # Deliver everything: the last segment, wholly acknowledged, is
            # given up for a new one, and appending works again.
            while (entry := spool.first()) is not None:
                await spool.ack((await spool.read(entry)).seq)
            out["after_ack"] = await spool.append(vec_batch(1, 20, seq_start=99_999))
        elif scenario == "ack":  # the ack itself refused: nothing changes, retried later
            import resource
            for i in range(3):
                await spool.append(vec_batch(1, 20, seq_start=i))
            last = spool._log.entries[-1].seq
            soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.setrlimit(resource.RLIMIT_FSIZE, (0, hard))  # no file may grow now
            try:
                await spool.ack(last)
            except OSError as exc:
                out["refused"] = exc.errno
            out["frames_after_refusal"] = len(spool)
            out["acked_after_refusal"] = spool.snapshot().acked_records
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            await spool.ack(last)  # the same call, again
            out["frames_after_ack"] = len(spool)
            out["acked_after_ack"] = spool.snapshot().acked_records
        elif timeout is not None:  # block with a timeout: shed as SpoolFull
            try:
                await fill(spool)
            except SpoolFull as exc:
                out["raised"] = str(exc)
            # The bound is per stall: the next appends, still refused, shed at once.
            started, again = trio.current_time(), 0
            for i in range(3):
                try:
                    await spool.append(vec_batch(1, 20, seq_start=50_000 + i))
                except SpoolFull:
                    again += 1
            out["shed_again"], out["waited_again"] = again, trio.current_time() - started
        else:  # block without a timeout: waits until a delivery makes room
            async def fill_until_blocked():
                for i in range(10_000):
                    outcome = await spool.append(vec_batch(1, 20, seq_start=i))
                    if spool.snapshot().disk_full_errors:
                        out["last"] = outcome  # the append that had to wait
                        return

            async with trio.open_nursery() as nursery:
                nursery.start_soon(fill_until_blocked)
                while spool.snapshot().disk_full_errors == 0:
                    await trio.sleep(1)  # mock time
                out["waiting_before_ack"] = "last" not in out
                frames = len(spool)
                while (entry := spool.first()) is not None:
                    await spool.ack((await spool.read(entry)).seq)
            out["acked_frames"] = frames
            out["unacked_frames"] = len(spool)
        await spool.aclose()
        reopened = Spool.open(config)
        out["damage"] = [d.reason for d in reopened.damage]
        out["replayed_frames"] = len(reopened)
        await reopened.aclose()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    print(json.dumps(out))
    """
)


def _limit_file_size() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))


def run_scenario(directory: Path, when_full: str, timeout: str) -> dict:
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", SCENARIO, str(directory), when_full, timeout],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        preexec_fn=_limit_file_size,
        capture_output=True,
        text=True,
        timeout=120,  # a hang guard only
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_drop_newest_on_a_full_disk_counts_and_appends_again_after_delivery(tmp_path):
    got = run_scenario(tmp_path / "spool", "drop_newest", "none")
    assert got["outcome"] == "dropped"
    assert got["spooled"] > 0
    assert got["dropped_records"] == 20
    assert got["disk_full_errors"] == 1
    assert got["after_ack"] == "spooled"  # the delivered last segment made room
    assert got["damage"] == []  # the refused frame left no torn tail


def test_block_with_a_timeout_on_a_full_disk_raises_spool_full(tmp_path):
    got = run_scenario(tmp_path / "spool", "block", "5")
    assert "no room on disk" in got["raised"]
    assert "5.0 s" in got["raised"]
    # Each later append waited its own 5 s (a destination's queue of N
    # batches took N x block_timeout to shed, and a flush waited that long);
    # until something is appended or acknowledged they shed at once.
    assert (got["shed_again"], got["waited_again"]) == (3, 0)
    assert got["damage"] == []


def test_block_on_a_full_disk_waits_for_delivery_then_appends(tmp_path):
    got = run_scenario(tmp_path / "spool", "block", "none")
    assert got["waiting_before_ack"] is True
    assert got["acked_frames"] > 0
    assert got["last"] == "spooled"  # the blocked append went through after the acks
    assert got["unacked_frames"] == 1  # just that one: nothing lost, nothing doubled
    assert got["damage"] == []


def test_an_ack_the_disk_refuses_changes_nothing_and_can_be_made_again(tmp_path):
    """The drain retries an ack (or a group's intent) the disk has no room for
    (``Delivery._with_room``); for that the refused ack must leave the spool as
    it was.  Before, its frames were already dropped from memory and counted
    nowhere, and the drain task's OSError failed the runtime ("runtime loop
    failed: OSError: [Errno 28]" under ``taproute run`` on a full tmpfs)."""
    got = run_scenario(tmp_path / "spool", "ack", "none")
    assert got["refused"] == errno.EFBIG
    assert got["frames_after_refusal"] == 3
    assert got["acked_after_refusal"] == 0
    assert got["frames_after_ack"] == 0
    assert got["acked_after_ack"] == 60
    assert got["replayed_frames"] == 0  # the ack is on disk
    assert got["damage"] == []


async def test_a_full_dead_letter_store_drops_and_counts_what_the_quota_sheds(tmp_path):
    """``when_full = "dead_letter"`` with the store out of room too (a full disk
    is usually both): the batch is dropped and counted.  Before, SQLite's
    ``database or disk is full`` left the spool and latched the router (seen
    with both on a full tmpfs under ``taproute run``).  SQLite refuses for real
    here: the store may grow no further than its size now (``max_page_count``)."""
    store = DeadLetterStore(tmp_path / "dl.sqlite")
    pages = store._db.execute("PRAGMA page_count").fetchone()[0]
    store._db.execute(f"PRAGMA max_page_count = {pages}")
    config = SpoolConfig(directory=tmp_path / "spool", quota_bytes=1, when_full="dead_letter")
    spool = Spool.open(config, dead_letter=destination_dead_letters(store.handle, "ch"))
    assert await spool.append(vec_batch(1, 4)) == "spooled"  # an empty spool takes any batch
    await spool.append(vec_batch(1, 1000))  # past the quota: to the store, which is full
    counters = spool.snapshot()
    assert counters.dropped_records == 1000
    assert counters.dead_lettered_records == 0
    assert store.list() == []
    await spool.aclose()
    store.close()
