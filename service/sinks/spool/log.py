"""The on-disk part of a spool: append-only segment files of checksummed frames.

A spool directory holds:

- ``spool.id``: a random id made when the directory is first used; with a
  frame's sequence number it makes a deduplication token that no other spool
  (nor this directory after it is wiped) ever produces again;
- ``NNNNNNNNNNNNNNNNNNNN.seg``: segments named by their first sequence number,
  each a run of frames ``header | body``; the header holds a magic, a CRC-32
  of (sequence, write time, body length, body), and those three fields;
- ``ack``: the highest sequence number delivered (acknowledged), with its
  own CRC, replaced atomically (write, rename);
- ``intent``: the first and last sequence of the group of frames being
  inserted together now (replaced atomically, and fsynced with its
  directory entry, before the insert), so a restart inserts exactly that
  group again, under the same token;
- ``pieces``: the tokens of the parts of the intended group already
  delivered while the destination refused some of its records (the drain
  splits such a group, and each part taken is an insert of its own),
  replaced durably after each, so a restart skips those parts instead of
  repeating them: every part taken pushes the ones before it towards the
  end of the table's deduplication window, and the repeats of enough of
  them came out of it, written twice;
- ``reserve``: 64 KiB held back for a full disk (given up so the ``ack`` and
  ``intent`` can still be written, and the spool drain and free room).

What survives a power loss: frames as the fsync policy made them durable,
and every frame of a group about to be inserted (an intent syncs the frames
first); the ``ack`` as of the last sync (the policy's); every ``intent``.
A group is intended only once every frame before it is acknowledged, so an
intent also stands for ``ack >= first - 1``: an ``ack`` file older than the
intent is read as that, and a lost ack replays only the intended group,
whole, under its own token, never a regrouped one.

Opening a directory scans every segment.  The first frame in a segment that is
short, has a bad magic, a bad checksum or a sequence number that does not
increase ends that segment: the bytes from there on are truncated and
reported as :class:`Damage` (a torn tail after a kill mid-append, or a corrupt
file), never replayed and never raised.  Frames at or below the acknowledged
sequence are skipped; a segment whose frames are all acknowledged is deleted.

This class does blocking IO and has no Trio in it; :class:`~.spool.Spool`
decides when it runs and on which thread.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import uuid
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs

# ISA-L's CRC-32 is zlib's CRC-32 (same polynomial, same values: the files
# are the same), about 5x faster here (14 vs 2.7 GB/s), so the checksum of a
# frame stops costing more than writing it.
from isal.isal_zlib import crc32 as _crc32

from taproute.service.sinks.spool.files import (
    fsync_dir,
    make_reserve,
    replace_durably,
    start_writeback,
    with_room,
    write_frame,
)

MAGIC = b"TRSF"
#: magic, crc32, sequence, written (ns since the epoch), body length
HEADER = struct.Struct("<4sIQQQ")
_CHECKED = struct.Struct("<QQQ")
ACK = struct.Struct("<QI")
_INTENT = struct.Struct("<QQI")
SUFFIX = ".seg"
#: Appended bytes after which their writeback is started (not waited for):
#: the disk writes while the spool appends, so an fsync finds little left.
WRITEBACK_BYTES = 1 << 20


@attrs.frozen
class Damage:
    """Bytes of a segment that were not a valid frame and were truncated away."""

    segment: str
    offset: int
    dropped_bytes: int
    reason: str

    def __str__(self) -> str:
        return (
            f"spool segment {self.segment}: {self.reason} at byte {self.offset}; "
            f"truncated {self.dropped_bytes} bytes (never replayed)"
        )


@attrs.frozen
class Entry:
    """One unacknowledged frame: where it lies and when it was written."""

    seq: int
    segment: Path
    offset: int
    size: int  # header + body
    written_ns: int


def _crc(seq: int, written_ns: int, buffers: Sequence[bytes | memoryview]) -> tuple[int, int]:
    length = sum(memoryview(b).nbytes for b in buffers)
    crc = _crc32(_CHECKED.pack(seq, written_ns, length))
    for b in buffers:
        crc = _crc32(b, crc)
    return crc, length


class SpoolLocked(OSError):
    """Another sink (in this process or another) has the spool directory open."""


def check_free(directory: Path) -> None:
    """Raise :class:`SpoolLocked` when a sink holds the spool in ``directory``
    now (its lock is taken and given back at once; nothing is read or created)."""
    try:
        fd = os.open(Path(directory) / "lock", os.O_RDWR)
    except FileNotFoundError:
        return  # never opened: nobody holds it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _locked(directory) from None
    finally:
        os.close(fd)  # releases the lock when this took it


def _locked(directory: Path) -> SpoolLocked:
    return SpoolLocked(f"spool {directory} is in use by another sink or process")


class SegmentLog:
    """Append, read and acknowledge frames in one spool directory (blocking IO)."""

    def __init__(self, directory: Path, *, segment_bytes: int) -> None:
        self.directory = Path(directory)
        self.segment_bytes = segment_bytes
        self.directory.mkdir(parents=True, exist_ok=True)
        # One writer per directory: two would interleave frames and acks.
        self._lock_fd: int | None = os.open(self.directory / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise _locked(self.directory) from None
        id_file = self.directory / "spool.id"
        if not id_file.exists():
            tmp = id_file.with_suffix(".tmp")
            tmp.write_text(uuid.uuid4().hex)
            os.replace(tmp, id_file)
            fsync_dir(self.directory)
        #: The directory's id (part of every deduplication token).
        self.spool_id = id_file.read_text().strip()
        #: Damage found (and truncated) when the directory was opened.
        self.damage: list[Damage] = []
        self.acked = self._read_ack()
        #: (first, last) of the group a previous run was inserting, if unacknowledged.
        self.intent = self._read_intent()
        #: Tokens of the intended group's parts already delivered (see ``pieces``).
        self.pieces: set[str] = self._read_pieces()
        if self.intent is not None and self.intent[0] - 1 > self.acked:
            # The ack before this intent was not durable (a power loss):
            # everything before the intended group had been acknowledged.
            self.acked = self.intent[0] - 1
        #: Unacknowledged frames, oldest first.
        self.entries: deque[Entry] = deque()
        #: segment path -> highest sequence it holds
        self.segments: dict[Path, int] = {}
        self.unacked_bytes = 0
        self.last_seq = self.acked
        self._active: Path | None = None
        self._active_fd: int | None = None
        self._active_size = 0
        self._written_back = 0  # bytes of the active segment whose writeback was started
        self._readers: dict[Path, int] = {}
        self._dirty_dir = False
        self._unsynced = False  # frames appended since the last sync
        self._recover()
        self._reserve_held = False  # the reserve file is there (see _restore_reserve)
        self._restore_reserve()
        if self._dirty_dir:  # segments recovery deleted stay deleted
            fsync_dir(self.directory)
            self._dirty_dir = False

    # -- opening -----------------------------------------------------------
    def _read_ack(self) -> int:
        path = self.directory / "ack"
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return 0
        if len(raw) == ACK.size:
            seq, crc = ACK.unpack(raw)
            if zlib.crc32(struct.pack("<Q", seq)) == crc:
                return int(seq)
        # A damaged ack file: replay everything still on disk (the
        # deduplication tokens make the repeats no-ops) rather than skip any.
        self.damage.append(Damage("ack", 0, len(raw), "acknowledged position unreadable"))
        return 0

    def _read_intent(self) -> tuple[int, int] | None:
        try:
            raw = (self.directory / "intent").read_bytes()
        except FileNotFoundError:
            return None
        if len(raw) == _INTENT.size:
            first, last, crc = _INTENT.unpack(raw)
            if zlib.crc32(raw[:16]) == crc and last > self.acked:
                return int(first), int(last)
        return None

    def _read_pieces(self) -> set[str]:
        """The parts recorded for the intended group (none for another group,
        or a damaged file: those parts are repeated, as before they were kept)."""
        try:
            raw = (self.directory / "pieces").read_bytes()
        except FileNotFoundError:
            return set()
        if self.intent is None or len(raw) < _INTENT.size:
            return set()
        first, last, crc = _INTENT.unpack(raw[: _INTENT.size])
        body = raw[_INTENT.size :]
        if (first, last) != self.intent or zlib.crc32(raw[:16] + body) != crc:
            return set()
        return set(body.decode().split("\n")) - {""}

    def note_piece(self, token: str) -> None:
        """Record, durably, that the part of the intended group inserted under
        ``token`` was delivered (see ``pieces``)."""
        assert self.intent is not None
        self.pieces.add(token)
        head = struct.pack("<QQ", *self.intent)
        body = "\n".join(sorted(self.pieces)).encode()
        data = head + struct.pack("<I", zlib.crc32(head + body)) + body
        self._record_progress(lambda: replace_durably(self.directory, "pieces", data))

    def _recover(self) -> None:
        paths = sorted(self.directory.glob("*" + SUFFIX))
        for tmp in self.directory.glob("*.tmp"):
            tmp.unlink()
        self._prev = 0
        for path in paths:
            last = self._scan(path)
            if last is None:
                path.unlink()
                self._dirty_dir = True
                continue
            if last <= self.acked:
                path.unlink()  # all delivered
                self._dirty_dir = True
                continue
            self.segments[path] = last
        self.unacked_bytes = sum(e.size for e in self.entries)

    def _scan(self, path: Path) -> int | None:
        """Index the valid frames of ``path``; truncate at the first bad one.

        Returns the segment's highest sequence, or None if it holds no frame.
        """
        data = path.read_bytes()
        offset, last = 0, None
        reason = None
        while offset < len(data):
            if len(data) - offset < HEADER.size:
                reason = "short frame header"
                break
            magic, crc, seq, written, length = HEADER.unpack_from(data, offset)
            if magic != MAGIC:
                reason = "bad frame magic"
                break
            end = offset + HEADER.size + length
            if end > len(data):
                reason = f"frame body of {length} bytes runs past the end"
                break
            body = memoryview(data)[offset + HEADER.size : end]
            if _crc(seq, written, [body])[0] != crc:
                reason = "checksum mismatch"
                break
            if seq <= self._prev:
                reason = f"sequence {seq} does not follow {self._prev}"
                break
            self._prev = seq
            self.last_seq = max(self.last_seq, seq)
            last = seq
            if seq > self.acked:
                self.entries.append(Entry(seq, path, offset, end - offset, written))
            offset = end
        if reason is not None:
            self.damage.append(Damage(path.name, offset, len(data) - offset, reason))
            with open(path, "r+b") as f:
                f.truncate(offset)
                os.fsync(f.fileno())
        return last

    # -- appending ---------------------------------------------------------
    def _restore_reserve(self) -> bool:
        """Hold the reserve back again if there is room; True when it is held."""
        if not self._reserve_held:
            made = make_reserve(self.directory)
            self._dirty_dir |= made
            self._reserve_held = made or (self.directory / "reserve").exists()
        return self._reserve_held

    def _record_progress(self, write: Callable[[], None]) -> None:
        """Write the ``ack`` or the ``intent`` (giving up the reserve on a full
        disk); appends wait for the reserve to be back (see :meth:`append`)."""
        try:
            with_room(self.directory, write)
        finally:
            if self._reserve_held and not (self.directory / "reserve").exists():
                self._reserve_held = False

    def append(self, buffers: Sequence[bytes | memoryview], written_ns: int) -> Entry:
        """Write one frame holding ``buffers`` (not yet fsynced: see :meth:`sync`).

        Refused as a full disk (``ENOSPC``) while the reserve, given up for
        an ack or an intent, cannot be held back again: the room it freed is
        the drain's, which frees more."""
        if not self._reserve_held and not self._restore_reserve():
            raise OSError(
                errno.ENOSPC, "no room: the spool's reserve is given up until room is made"
            )
        seq = self.last_seq + 1
        crc, length = _crc(seq, written_ns, buffers)
        if self._active_fd is None or self._active_size >= self.segment_bytes:
            self._roll(seq)
        assert self._active_fd is not None and self._active is not None
        offset = self._active_size
        header = HEADER.pack(MAGIC, crc, seq, written_ns, length)
        try:
            write_frame(
                self._active_fd, [memoryview(header)] + [memoryview(b).cast("B") for b in buffers]
            )
        except BaseException:
            # Leave no half frame behind a later good one.
            os.ftruncate(self._active_fd, offset)
            raise
        size = HEADER.size + length
        self._unsynced = True
        self._active_size += size
        if self._active_size - self._written_back >= WRITEBACK_BYTES:
            start_writeback(
                self._active_fd, self._written_back, self._active_size - self._written_back
            )
            self._written_back = self._active_size
        self.last_seq = seq
        self.segments[self._active] = seq
        entry = Entry(seq, self._active, offset, size, written_ns)
        self.entries.append(entry)
        self.unacked_bytes += size
        return entry

    def rolls_next(self) -> bool:
        """Whether the next :meth:`append` closes a full segment first (an
        fsync of it: disk time, not page-cache time)."""
        return self._active_fd is not None and self._active_size >= self.segment_bytes

    def retire_active(self) -> bool:
        """Close and delete the segment being appended to when every frame in
        it is acknowledged, so the next append starts a new file; False when
        it still holds an unacknowledged frame (or nothing).

        Segments are deleted once wholly delivered, but the active one only
        when it rolls: on a full disk (or a file-size limit) a spool that
        has delivered everything would otherwise keep its last segment's
        bytes and refuse every append.
        """
        active = self._active
        if active is None or self._active_fd is None or self._active_size == 0:
            return False
        if self.entries and self.entries[-1].segment == active:
            return False
        os.close(self._active_fd)
        self._active_fd = None
        self._active = None
        self._active_size = 0
        self._written_back = 0
        self.segments.pop(active, None)
        reader = self._readers.pop(active, None)
        if reader is not None:
            os.close(reader)  # an open descriptor keeps the bytes allocated
        active.unlink()
        self._restore_reserve()
        self._dirty_dir = True
        return True

    def _roll(self, seq: int) -> None:
        if self._active_fd is not None:
            os.fsync(self._active_fd)
            # Forgotten before the next open, which may fail (EROFS, ENOSPC):
            # a stale number was fsynced and closed again (EBADF, or another
            # file's descriptor once reused).
            fd, self._active_fd = self._active_fd, None
            os.close(fd)
        self._active = self.directory / f"{seq:020d}{SUFFIX}"
        self._active_fd = os.open(self._active, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._active_size = 0
        self._written_back = 0
        self._dirty_dir = True

    # -- reading and acknowledging -----------------------------------------
    def read(self, entry: Entry) -> memoryview:
        """The body of ``entry`` (checked again: a file changed under us is an error)."""
        fd = self._readers.get(entry.segment)
        if fd is None:
            fd = self._readers[entry.segment] = os.open(entry.segment, os.O_RDONLY)
        raw = os.pread(fd, entry.size, entry.offset)
        magic, crc, seq, written, _length = HEADER.unpack_from(raw)
        body = memoryview(raw)[HEADER.size :]
        if magic != MAGIC or seq != entry.seq or _crc(seq, written, [body])[0] != crc:
            raise OSError(f"spool segment {entry.segment.name}: frame {entry.seq} changed on disk")
        return body

    def read_many(self, entries: Sequence[Entry]) -> list[memoryview]:
        """The bodies of ``entries`` (one thread trip for a drain group)."""
        return [self.read(entry) for entry in entries]

    def intend(self, first: int, last: int) -> None:
        """Record that frames ``first..last`` are inserted together next (see
        the module docstring): replaced atomically and durable, with every
        frame appended so far (the segment, the file and its directory entry
        fsynced) when this returns, whatever the fsync policy, because the
        insert that follows must be repeatable as is after a power loss."""
        if self._unsynced:  # the frames first: a replay must find the whole group
            self.sync()
        raw = struct.pack("<QQ", first, last)
        data = raw + struct.pack("<I", zlib.crc32(raw))
        self._record_progress(lambda: replace_durably(self.directory, "intent", data))
        if self.intent != (first, last):
            self.pieces = set()
        self.intent = (first, last)

    def ack(self, seq: int) -> list[Entry]:
        """Acknowledge every frame up to ``seq``; delete segments wholly delivered.

        The ``ack`` file is written first: when that fails (a full disk with
        the reserve already given up) nothing has changed, and the same call
        can be made again."""
        acked = max(self.acked, seq)
        tmp = self.directory / "ack.tmp"
        data = ACK.pack(acked, zlib.crc32(struct.pack("<Q", acked)))

        def write() -> None:
            tmp.write_bytes(data)
            os.replace(tmp, self.directory / "ack")

        self._record_progress(write)
        self._dirty_dir = True  # the rename is durable once the directory is synced
        done: list[Entry] = []
        while self.entries and self.entries[0].seq <= seq:
            entry = self.entries.popleft()
            self.unacked_bytes -= entry.size
            done.append(entry)
        self.acked = acked
        if self.intent is not None and self.intent[1] <= self.acked:
            self.intent = None
            self.pieces = set()
        deleted = False
        for path, last in list(self.segments.items()):
            if last <= self.acked and path != self._active:
                del self.segments[path]
                reader = self._readers.pop(path, None)
                if reader is not None:
                    os.close(reader)
                path.unlink()
                deleted = True
        if deleted:  # room made: hold the reserve back again
            self._restore_reserve()
            self._dirty_dir = True
        return done

    def sync(self) -> None:
        """Make every appended frame, the ack position and the file names durable."""
        self._unsynced = False
        if self._active_fd is not None:
            os.fsync(self._active_fd)
        ack = self.directory / "ack"
        if ack.exists():
            fd = os.open(ack, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        if self._dirty_dir:
            fsync_dir(self.directory)
            self._dirty_dir = False

    @property
    def segment_count(self) -> int:
        """Segment files on disk."""
        return len(self.segments)

    def close(self) -> None:
        """Sync and close every file (the directory stays for the next open)."""
        self.sync()
        if self._active_fd is not None:
            os.close(self._active_fd)
            self._active_fd = None
        for fd in self._readers.values():
            os.close(fd)
        self._readers.clear()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the lock
            self._lock_fd = None


__all__ = ["ACK", "HEADER", "MAGIC", "SUFFIX", "Damage", "Entry", "SegmentLog", "SpoolLocked"]
