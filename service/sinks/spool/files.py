"""Blocking file primitives a spool's segment log is built on: whole writes
(``os.write`` and ``os.writev`` may write less than asked), a directory's
fsync (what makes a new or renamed name durable), and a durable atomic
replace of a small file."""

from __future__ import annotations

import os
from pathlib import Path


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


__all__ = ["IOV_MAX", "fsync_dir", "replace_durably", "write_all", "write_frame"]
