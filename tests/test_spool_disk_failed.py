"""A spool whose disk fails with an error other than "no room" (here a real
``EROFS``: the spool's directory remounted read-only under it) costs only
its own destination: the records it cannot keep are shed and counted, the
destination is unhealthy with a reason naming the error and the spool's
directory, and the other destinations keep flowing.

Before the fix the ``OSError`` left ``SpoolingSink.submit`` and latched the
router's failure: capture detached and every destination stopped.

The read-only mount needs root (CI runs as root): a bind mount of the spool's
directory over itself, remounted read-only while the spool's current segment
stays open, so the next segment's creation is refused by the kernel.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import trio

from taproute.actors import RoutingSink
from taproute.routing import Route, RoutingConfig
from taproute.service import CaptureSink, create_record_runtime
from taproute.service.sinks.spool import Spool, SpoolConfig
from taproute.service.sinks.spool.spooling import SpoolingSink
from tests.conftest import vec_batch
from tests.processors import SCHEMA


def _bind_mount_refused() -> str | None:
    """Why this machine cannot make a read-only bind mount (None: it can):
    not root, or root in a container without the right to mount."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root to remount the spool's directory read-only (CI runs as root)"
    with tempfile.TemporaryDirectory() as probe:
        tried = subprocess.run(
            ["mount", "--bind", probe, probe], capture_output=True, text=True, check=False
        )
        if tried.returncode != 0:
            return f"this machine refuses bind mounts: {tried.stderr.strip() or tried.returncode}"
        subprocess.run(["umount", "-l", probe], check=True)
    return None


_REFUSED = _bind_mount_refused()
pytestmark = pytest.mark.skipif(_REFUSED is not None, reason=_REFUSED or "")


@contextlib.contextmanager
def read_only(directory: Path) -> Iterator[None]:
    """``directory`` read-only (a bind mount over itself) until the block ends."""
    subprocess.run(["mount", "--bind", str(directory), str(directory)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(directory)], check=True)
        yield
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=True)


def test_a_spool_on_a_failed_disk_sheds_its_destination_and_the_others_flow(tmp_path):
    directory = tmp_path / "spool"
    # Tiny segments: a new file (refused on the read-only mount) every few frames.
    spool = Spool.open(SpoolConfig(directory=directory, segment_bytes=1 << 10))
    bad = SpoolingSink("bad", CaptureSink(), spool, mode="always")
    good = CaptureSink()
    sink = RoutingSink(
        RoutingConfig([Route("to_bad", "layers.*", "bad"), Route("to_good", "layers.*", "good")]),
        SCHEMA,
        {"bad": lambda: bad, "good": lambda: good},
        unmatched="drop",
    )
    with create_record_runtime(record_sink=sink) as runtime:
        q = runtime.bind_hook("layers.0.q", layout="vec")
        runtime.submit(q, np.full(4, 0, np.float32))
        runtime.flush()
        with read_only(directory):
            for i in range(1, 50):
                runtime.submit(q, np.full(4, i, np.float32))  # never raises
                runtime.flush()
            status = bad.spool_status()
            assert sink.failure is None
        assert sum(len(b) for b in good.batches) == 50  # the other destination flowed
        assert not status.healthy
        assert "EROFS" in status.reason and str(directory) in status.reason
        assert status.shed_records > 0
        # The disk is back: the spool takes batches again, the destination is healthy.
        runtime.submit(q, np.full(4, 50, np.float32))
        runtime.flush()
        assert bad.spool_status().healthy
        shed = bad.snapshot().shed_records
    assert sink.failure is None
    counters = bad.snapshot()
    assert counters.accepted_records == 51 and counters.shed_records == shed
    assert counters.delivered_records + shed == 51  # each record delivered or shed, once
    assert sum(len(b) for b in good.batches) == 51


def test_a_destination_whose_spool_disk_fails_closes_without_waiting_to_drain(tmp_path):
    directory = tmp_path / "spool"

    async def leave_a_batch() -> None:  # held for delivery at the next start
        spool = Spool.open(SpoolConfig(directory=directory))
        await spool.append(vec_batch(0, 3))
        await spool.aclose()

    trio.run(leave_a_batch)
    spool = Spool.open(SpoolConfig(directory=directory, segment_bytes=1 << 10))
    bad = SpoolingSink("bad", CaptureSink(), spool, mode="always", drain_on_close=600)
    sink = RoutingSink(
        RoutingConfig([Route("to_bad", "layers.*", "bad")]),
        SCHEMA,
        {"bad": lambda: bad},
        unmatched="drop",
    )
    with read_only(directory):
        started = time.monotonic()
        with create_record_runtime(record_sink=sink) as runtime:
            q = runtime.bind_hook("layers.0.q", layout="vec")
            for i in range(5):
                runtime.submit(q, np.full(4, i, np.float32))  # shed: no segment can be made
            runtime.flush()
            assert not bad.spool_status().healthy
        # Closed while the disk still fails: the drain cannot record its
        # progress, so close did not wait out drain_on_close (600 s), and
        # nothing latched; the left batch stays on disk for the next start.
        assert time.monotonic() - started < 60
        assert sink.failure is None and not bad.running
        assert bad.snapshot().shed_records == 5
    reopened = Spool.open(SpoolConfig(directory=directory))
    assert len(reopened) == 1
    trio.run(reopened.aclose)
