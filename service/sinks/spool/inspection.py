"""What a spool directory holds, read without opening (or locking) it: for
``taproute check``'s warning about a spool older than ten minutes."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import attrs

from taproute.service.sinks.spool.log import ACK, HEADER, MAGIC, SUFFIX


@attrs.frozen
class Inspection:
    """What a spool directory holds, read without changing it (for ``check``)."""

    frames: int
    bytes: int
    oldest_written_ns: int | None


def inspect(directory: Path) -> Inspection:
    """Count the unacknowledged frames of a spool directory, read-only.

    A damaged tail is not counted (opening the spool truncates it).
    """
    directory = Path(directory)
    acked = 0
    try:
        raw = (directory / "ack").read_bytes()
        if len(raw) == ACK.size:
            seq, crc = ACK.unpack(raw)
            if zlib.crc32(struct.pack("<Q", seq)) == crc:
                acked = int(seq)
    except FileNotFoundError:
        pass
    frames = size = 0
    oldest: int | None = None
    for path in sorted(directory.glob("*" + SUFFIX)):
        data = path.read_bytes()
        offset = 0
        while len(data) - offset >= HEADER.size:
            magic, crc, seq, written, length = HEADER.unpack_from(data, offset)
            end = offset + HEADER.size + length
            if magic != MAGIC or end > len(data):
                break
            if seq > acked:
                frames += 1
                size += end - offset
                oldest = written if oldest is None else min(oldest, written)
            offset = end
    return Inspection(frames, size, oldest)


__all__ = ["Inspection", "inspect"]
