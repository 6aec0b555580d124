"""A spooling destination whose spool's disk failed stays unhealthy until
the spool's directory takes a new file again, not merely until some spool
operation succeeds.

Before, any successful spool operation marked the disk recovered.  On a
file system remounted read-only (``EROFS``), or a directory that refuses new
files for another reason (here ``chattr +i``: ``EPERM``, the path
``EACCES`` and ``EIO`` take too), a frame is still appended to the segment
opened before, while the drain's ``intent`` (a new file) is refused: the
destination read healthy after every append and unhealthy again at the
drain's next try, a flicker an operator's probe of ``/healthz`` caught
either way.

Real failures from the kernel: a read-only bind mount, an immutable
directory (both need root, and skip saying why where it is refused).
Nothing waits by sleeping: ``flush()`` returns once the append is durable,
and the drain's first failure is awaited on the destination's health.
"""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from taproute.actors import RoutingSink
from taproute.routing import Route, RoutingConfig
from taproute.service import CaptureSink, create_record_runtime
from taproute.service.sinks.spool import Spool, SpoolConfig
from taproute.service.sinks.spool.spooling import SpoolingSink
from tests.processors import SCHEMA
from tests.test_runtime import eventually
from tests.test_spool_disk_failed import _REFUSED, read_only

GUARD_S = 60.0


def _immutable_refused() -> str | None:
    """Why this machine cannot make a directory immutable (None: it can)."""
    with tempfile.TemporaryDirectory() as probe:
        tried = subprocess.run(["chattr", "+i", probe], capture_output=True, text=True, check=False)
        if tried.returncode != 0:
            return f"chattr +i refused (needs root on ext4/xfs): {tried.stderr.strip()}"
        subprocess.run(["chattr", "-i", probe], check=True)
    return None


def _chattr_refusal() -> str | None:
    try:
        return _immutable_refused()
    except FileNotFoundError as exc:
        return f"no chattr: {exc}"


_IMMUTABLE_REFUSED = _chattr_refusal()


@contextlib.contextmanager
def immutable(directory: Path) -> Iterator[None]:
    """``directory`` refuses new files (EPERM, even to root) until the block ends."""
    subprocess.run(["chattr", "+i", str(directory)], check=True)
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(directory)], check=True)


@pytest.mark.parametrize(
    ("failure", "code"),
    [
        pytest.param(
            read_only,
            "EROFS",
            marks=pytest.mark.skipif(_REFUSED is not None, reason=_REFUSED or ""),
        ),
        pytest.param(
            immutable,
            "EPERM",
            marks=pytest.mark.skipif(
                _IMMUTABLE_REFUSED is not None, reason=_IMMUTABLE_REFUSED or ""
            ),
        ),
    ],
)
def test_a_failed_spool_disk_reads_unhealthy_until_it_takes_a_new_file(tmp_path, failure, code):
    directory = tmp_path / "spool"
    spool = Spool.open(SpoolConfig(directory=directory))  # one segment: appends go into it
    bad = SpoolingSink("bad", CaptureSink(), spool, mode="always")
    sink = RoutingSink(
        RoutingConfig([Route("to_bad", "layers.*", "bad")]),
        SCHEMA,
        {"bad": lambda: bad},
        unmatched="drop",
    )
    with create_record_runtime(record_sink=sink) as runtime:
        q = runtime.bind_hook("layers.0.q", layout="vec")
        runtime.submit(q, np.full(4, 0, np.float32))
        runtime.flush(wait=True)  # delivered: the spool is empty, the drain waits
        assert bad.spool_status().healthy
        with failure(directory):
            runtime.submit(q, np.full(4, 1, np.float32))
            runtime.flush()  # appended to the open segment
            # The drain cannot record the group's intent (a new file).
            eventually(lambda: not bad.spool_status().healthy, GUARD_S)
            for i in range(2, 12):
                runtime.submit(q, np.full(4, i, np.float32))
                runtime.flush()  # appended, durable: a write that succeeded
                status = bad.spool_status()
                assert not status.healthy, i  # read healthy here before
                assert code in (status.reason or "") and str(directory) in (status.reason or "")
            assert bad.snapshot().shed_records == 0  # every append was kept
        # The disk takes files again: the next append finds it so.
        runtime.submit(q, np.full(4, 12, np.float32))
        runtime.flush(wait=True)
        assert bad.spool_status().healthy
    assert sink.failure is None
    counters = bad.snapshot()
    assert counters.accepted_records == counters.delivered_records == 13
    inner = bad.inner
    assert isinstance(inner, CaptureSink)
    values = [
        int(np.frombuffer(b.payload_of(i), np.float32)[0])
        for b in inner.record_batches
        for i in range(len(b))
    ]
    assert sorted(values) == list(range(13))  # each record delivered once
