"""An insert's Arrow table as a file chDB reads without the GIL.

chDB's ``Python()`` table function reads an Arrow table through the Python
objects that hold it, with the GIL held for part of the read (a few ms of a
10 MB insert here, time a model's Python thread in the same process waits).
Written out as an Arrow IPC stream by pyarrow (which releases the GIL while it
writes) into an anonymous in-memory file (``memfd_create``: no path on any
file system, gone with the process), the same table is read by chDB's
``file()`` table function from ``/proc/self/fd/<n>``, a query that takes the
GIL only to start and to return.

The price is one more copy of the block (the stream), about 6 ms of CPU
per 10 MB here, outside the GIL; ``ChdbTransport(scratch_inserts=True)``
chooses it.  Linux only (``memfd_create`` and ``/proc``):
:func:`scratch_files_work` says why this process cannot use them (None: it
can), checked with a real read through chDB until it once succeeds.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pyarrow as pa


class ArrowScratch:
    """One in-memory file holding the Arrow IPC stream of one insert at a time.

    Not thread-safe: one per insert connection.  Between inserts it holds
    no memory (:meth:`clear`); during one it holds the table's bytes once
    more (the IPC stream), as ``Python()`` holds chDB's own copy of them.
    """

    def __init__(self) -> None:
        self._fd = os.memfd_create("taproute-insert", os.MFD_CLOEXEC)
        #: The path chDB's ``file()`` opens (this process's own descriptor).
        self.path = f"/proc/self/fd/{self._fd}"

    def write(self, data: pa.Table) -> None:
        """Replace the file's contents with ``data`` as one Arrow IPC stream
        (a dictionary column whose chunks carry different dictionaries, as a
        block of batches converted under two versions of the hook names does,
        is written as a dictionary replacement, which chDB reads)."""
        with (
            pa.OSFile(self.path, "wb") as sink,  # truncates: the previous block is gone
            pa.ipc.new_stream(sink, data.schema) as writer,
        ):
            writer.write_table(data)

    @property
    def size(self) -> int:
        """Bytes the file holds now."""
        return os.fstat(self._fd).st_size

    def clear(self) -> None:
        """Give the file's memory back (size 0)."""
        os.ftruncate(self._fd, 0)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def source(self) -> str:
        """The table function reading the file (in a ``SELECT ... FROM``)."""
        return f"file('{self.path}', 'ArrowStream')"


#: What every read of a scratch file runs with: no schema cache (one file
#: carries every table's blocks, and its path and time say nothing of its
#: columns).
SCRATCH_READ_SETTINGS = "schema_inference_use_cache_for_file = 0"


#: Whether :func:`scratch_files_work` found them working once in this process.
_worked = False


def scratch_files_work(session: Any) -> str | None:
    """Why chDB in this process cannot read an :class:`ArrowScratch` file
    back, or None when it can (Linux with ``memfd_create`` and ``/proc``,
    and a chDB whose ``file()`` opens the path).  Checked with one row
    through ``session`` (a chDB session); a success is remembered for the
    process, a failure is checked again next time (it may have been
    passing: out of file descriptors, say)."""
    global _worked
    if _worked:
        return None
    reason = _check(session)
    _worked = reason is None
    return reason


def _check(session: Any) -> str | None:
    if not sys.platform.startswith("linux") or not hasattr(os, "memfd_create"):
        return "no memfd_create here (Linux only)"
    try:
        scratch = ArrowScratch()
    except OSError as exc:
        return f"could not make an in-memory file: {exc}"
    try:
        scratch.write(pa.table({"x": pa.array([7], pa.int32())}))
        result = session.query(
            f"SELECT sum(x) FROM {scratch.source()} SETTINGS {SCRATCH_READ_SETTINGS}", "CSV"
        )
        got = bytes(result.bytes()).strip()
    except Exception as exc:
        return f"chDB could not read it back: {type(exc).__name__}: {exc}"
    finally:
        scratch.close()
    if got != b"7":
        return f"chDB read it back wrong: {got[:80]!r} for b'7'"
    return None
