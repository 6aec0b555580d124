"""Blocking file primitives a spool's segment log is built on: whole writes
(``os.write`` and ``os.writev`` may write less than asked), a directory's
fsync (what makes a new or renamed name durable), a durable atomic
replace of a small file, and the reserve given up on a full disk."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import sys
from collections.abc import Callable
from pathlib import Path

#: Errors that mean the file system has no room: a full disk, a disk quota,
#: a file-size limit (RLIMIT_FSIZE).
NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
#: Bytes held in a directory's ``reserve`` file and given up when the disk is
#: full, so that small files written as new files and renamed over (a spool's
#: ``ack`` and ``intent``) can still be written: the spool then drains, and
#: draining frees room.
RESERVE_BYTES = 64 << 10


def write_all(fd: int, data: bytes | memoryview) -> None:
    """Write all of ``data`` (``os.write`` may take less)."""
    view = memoryview(data).cast("B")
    while view:
        written = os.write(fd, view)
        view = view[written:]


#: Buffers one ``writev`` takes (Linux's IOV_MAX is 1024).
IOV_MAX = 1024


def write_frame(fd: int, buffers: list[memoryview]) -> None:
    """Write ``buffers`` in order with as few system calls as the kernel allows."""
    pending = [b for b in buffers if b.nbytes]
    while pending:
        chunk = pending[:IOV_MAX]
        written = os.writev(fd, chunk)
        if written == sum(b.nbytes for b in chunk):
            pending = pending[len(chunk) :]
            continue
        # A short write (a signal, a full disk): finish the rest one by one.
        for i, b in enumerate(chunk):
            if written >= b.nbytes:
                written -= b.nbytes
                continue
            write_all(fd, b[written:])
            written = 0
            for rest in chunk[i + 1 :]:
                write_all(fd, rest)
            break
        pending = pending[len(chunk) :]


#: ``sync_file_range(2)``'s flag that starts writeback of a range's dirty
#: pages and returns without waiting for it.
_SYNC_FILE_RANGE_WRITE = 2


def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's ``sync_file_range`` (Linux only; Python's ``os`` lacks it)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        function = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_SYNC_RANGE = _sync_file_range()


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``nbytes`` of ``fd`` from ``offset`` to
    disk now, without waiting (Linux; elsewhere nothing).  Durability is
    unchanged (only ``fsync`` promises it), but the ``fsync`` that follows
    finds most pages already written instead of writing them all while
    the caller waits.  Errors are ignored: the ``fsync`` reports them."""
    if _SYNC_RANGE is not None:
        _SYNC_RANGE(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def fsync_dir(directory: Path) -> None:
    """fsync ``directory``: names created, renamed or deleted in it become durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_durably(directory: Path, name: str, data: bytes) -> None:
    """Replace ``directory/name`` with ``data`` atomically and durably: write
    a temporary file, fsync it, rename it over, fsync the directory."""
    tmp = directory / (name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, directory / name)
    fsync_dir(directory)


def check_writes(directory: Path) -> None:
    """Create, write, fsync and remove a small file in ``directory``: raises
    the ``OSError`` its disk gives (read-only, I/O error, permission).  A
    spool whose disk failed is healthy again only once this works: a write
    into a segment opened before a file system went read-only still
    succeeds, and proves nothing about the next segment, ``intent`` or
    ``ack``.  The name ends in ``.tmp``: a spool opening the directory
    removes one left behind."""
    path = directory / "writes.tmp"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, b"\0")
        os.fsync(fd)
    finally:
        os.close(fd)
    os.unlink(path)


__all__ = [
    "IOV_MAX",
    "check_writes",
    "fsync_dir",
    "replace_durably",
    "start_writeback",
    "write_all",
    "write_frame",
]


def with_room(directory: Path, write: Callable[[], None]) -> bool:
    """Run ``write``; on a full disk, give up ``directory``'s reserve and run
    it again.  True when the reserve was given up (a name left the directory)."""
    try:
        write()
    except OSError as exc:
        reserve = directory / "reserve"
        if exc.errno not in NO_ROOM or not reserve.exists():
            raise
        reserve.unlink()
        write()
        return True
    return False


def make_reserve(directory: Path) -> bool:
    """Put ``directory``'s reserve (:data:`RESERVE_BYTES`) back if it is missing
    and there is room; True when a new name was made."""
    reserve = directory / "reserve"
    if reserve.exists():
        return False
    tmp = directory / "reserve.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(bytes(RESERVE_BYTES))
        os.replace(tmp, reserve)
    except OSError as exc:
        if exc.errno not in NO_ROOM:
            raise
        tmp.unlink(missing_ok=True)
        return False
    return True
