"""A durable, ordered queue of whole batches for one destination.

:class:`Spool` puts batches on disk (a :class:`~.log.SegmentLog`) and hands
them back oldest first; a batch leaves the spool only when it is
acknowledged (delivered, or given up on by the caller's failure policy), so
a crash at any point replays what was not acknowledged, in order.  Every
frame's deduplication token (:meth:`Spool.token`) is derived from the
spool's id and the frame's sequence number, so a replay of a batch the
destination already took is recognised as a repeat.

The quota policy is explicit (:class:`~.config.SpoolConfig`): ``block``
waits for room, ``drop_newest`` refuses the batch and counts it,
``dead_letter`` hands it to the caller's dead-letter callback and counts
it.  Nothing leaves without a counter.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Literal

import attrs
import trio

from taproute.routing.batch import Batch, RecordBatch, RowBatch
from taproute.routing.hooks import HookRegistry
from taproute.service.sinks.spool.codec import decode, encode
from taproute.service.sinks.spool.config import SpoolConfig
from taproute.service.sinks.spool.files import NO_ROOM, check_writes
from taproute.service.sinks.spool.log import HEADER, Damage, Entry, SegmentLog

#: Called with (batch, reason) for a batch the ``dead_letter`` policy sheds
#: (or a destination refused); raises :class:`CannotDeadLetter` for a batch
#: its store has no place for (the batch is then dropped and counted).
DeadLetter = Callable[[Batch, str], Awaitable[None]]


class CannotDeadLetter(Exception):
    """The dead-letter store cannot keep this kind of batch."""


#: Frames up to this size are always written on the loop (a page-cache copy).
_SMALL_BYTES = 256 << 10
#: Frames up to this size are written on the loop too while the disk takes
#: writes at page-cache speed (about 0.2 to 0.6 ms a MiB here); larger ones,
#: and a frame that closes a full segment (an fsync), in a worker thread.  A
#: thread trip per frame cost more than the write (1 MiB frames: the appends
#: ran at 0.80x a plain write loop with a trip each, 0.98x inline).
_INLINE_BYTES = 2 << 20
#: An append of a frame over :data:`_SMALL_BYTES` slower than this (the kernel
#: throttling dirty pages, a disk that stalls, a starved core) sends the next
#: such frames to a worker thread, until one is written there at least this
#: fast again: a slow disk holds the loop for one write, not for every one.
_SLOW_WRITE_S = 0.004

Outcome = Literal["spooled", "dropped", "dead_lettered"]

#: How often ``block`` retries on a full disk when nothing was acknowledged.
_DISK_POLL = 1.0

logger = logging.getLogger("taproute.spool")


class SpoolFull(Exception):
    """The spool stayed at its quota for longer than ``block_timeout``."""


@attrs.define
class SpoolCounters:
    """What a spool holds and has done (one destination's)."""

    bytes: int = 0
    segments: int = 0
    frames: int = 0  # unacknowledged (a frame: batches inserted together)
    oldest_unacked_age_s: float = 0.0
    appended_batches: int = 0
    appended_records: int = 0
    acked_batches: int = 0
    acked_records: int = 0
    acked_bytes: int = 0
    dropped_batches: int = 0
    dropped_records: int = 0
    dead_lettered_batches: int = 0
    dead_lettered_records: int = 0
    damaged_bytes: int = 0
    blocked_seconds: float = 0.0
    disk_full_errors: int = 0  # appends the file system refused for want of room


@attrs.frozen
class Spooled:
    """Frames read back from the spool: their batches (inserted together
    under ``token``) and their positions ``first..seq``."""

    seq: int
    batches: tuple[Batch, ...]
    token: str
    records: int
    first: int = attrs.field(default=-1)

    def __attrs_post_init__(self) -> None:
        if self.first < 0:
            object.__setattr__(self, "first", self.seq)


#: Most frames one drain group holds.
_GROUP_FRAMES = 4096


class Spool:
    """One destination's spool; every method runs on the Trio loop.

    Open with :meth:`open` (it recovers the directory: :attr:`damage` lists
    what was truncated).  ``append`` / ``first`` / ``ack`` / ``sync``;
    ``close`` syncs and releases the files.
    """

    def __init__(
        self,
        config: SpoolConfig,
        log: SegmentLog,
        *,
        dead_letter: DeadLetter | None,
        clock: Callable[[], float],
    ) -> None:
        self.config = config
        self._log = log
        self._dead_letter = dead_letter
        self._clock = clock
        self._changed = trio.Event()  # set on every append and ack
        # One writer at a time; also held while a group's intent is written,
        # since that fsyncs the segment an append may roll or retire.
        self._lock = trio.Lock()
        # Held while frames are read in a worker thread (the drain reads, not
        # the writers): closing waits for it, as the read uses the readers'
        # descriptors that closing closes.
        self._reading = trio.Lock()
        self._last_sync = clock()
        self._unsynced = False  # nothing appended or acknowledged since the last sync
        self._records: dict[int, tuple[int, int]] = {}  # seq -> (records, batches)
        self._budget: float | None = None  # the producer's, when block_timeout is unset
        self.counters = SpoolCounters(damaged_bytes=sum(d.dropped_bytes for d in log.damage))
        self._no_room: OSError | None = None  # the last disk-full error, until an append succeeds
        # A ``block`` wait ran out and nothing was appended or acknowledged
        # since: the next one sheds at once (the bound is per stall, not per
        # batch, as the runtime's max_block).
        self._stalled = False
        self._disk_slow = False  # the last timed append was slow: mid-size frames go to a thread
        self._timer: Callable[[], float] = time.perf_counter  # times appends (tests replace it)
        self._hooks: HookRegistry | None = None  # names records' hooks in frames

    def use_hooks(self, hooks: HookRegistry) -> None:
        """Store the names of records' hooks from ``hooks`` with them, and map
        the names of frames read back to the output ids ``hooks`` gives them
        (a restart may bind hooks in another order)."""
        self._hooks = hooks

    @classmethod
    def open(
        cls,
        config: SpoolConfig,
        *,
        dead_letter: DeadLetter | None = None,
        clock: Callable[[], float] = time.time,
    ) -> Spool:
        """Open (creating or recovering) the spool in ``config.directory``."""
        if config.when_full == "dead_letter" and dead_letter is None:
            from taproute.routing.errors import ConfigError

            raise ConfigError(
                f"spool {config.directory}: when_full='dead_letter' needs a dead-letter store"
            )
        return cls(
            config,
            SegmentLog(config.directory, segment_bytes=config.segment_bytes),
            dead_letter=dead_letter,
            clock=clock,
        )

    @property
    def damage(self) -> list[Damage]:
        """What opening the directory found damaged and truncated (never replayed)."""
        return list(self._log.damage)

    @property
    def spool_id(self) -> str:
        return self._log.spool_id

    def token(self, seq: int) -> str:
        """The deduplication token of frame ``seq`` (stable across restarts)."""
        return f"spool-{self._log.spool_id}-{seq}"

    def __len__(self) -> int:
        """Unacknowledged frames."""
        return len(self._log.entries)

    @property
    def unacked_bytes(self) -> int:
        return self._log.unacked_bytes

    def _has_room(self, size: int) -> bool:
        used = self._log.unacked_bytes
        return used == 0 or used + size <= self.config.quota_bytes

    def _changed_now(self) -> None:
        self._stalled = False
        self._changed.set()
        self._changed = trio.Event()

    async def append(self, batch: Batch | Sequence[Batch], token: str | None = None) -> Outcome:
        """Put ``batch`` (or several, as one frame) on disk, applying the quota
        policy when the spool is full.

        ``"spooled"``: it is in the spool (durable per the fsync policy);
        ``"dropped"`` / ``"dead_lettered"``: the policy shed it (counted).
        Raises :class:`SpoolFull` when ``block`` waited ``block_timeout``,
        and then at once, without waiting, until something is appended or
        acknowledged (the bound is per stall).  A file system out of room
        (``ENOSPC``, ``EDQUOT``, ``EFBIG``) is a full spool too: the same
        policy applies (``block`` retries at every acknowledgement, and at
        least every second), never an error.
        ``token``: a deduplication token the batch was already sent with.
        """
        batches = [batch] if isinstance(batch, (RecordBatch, RowBatch)) else list(batch)
        records = sum(len(b) for b in batches)
        buffers = encode(batches, token, self._hooks)
        size = HEADER.size + sum(memoryview(b).nbytes for b in buffers)
        if not self._has_room(size):
            shed = await self._shed(batches, records)
            if shed is not None:
                return shed
            await self._wait_for_room(size)
        deadline: float | None = None  # of ``block`` on a full disk
        while True:
            try:
                await self._write(buffers, records, len(batches))
            except OSError as exc:
                if exc.errno not in NO_ROOM:
                    raise
                self._note_no_room(exc)
                shed = await self._shed(batches, records)
                if shed is not None:
                    return shed
                if deadline is None:
                    deadline = trio.current_time() + self.block_timeout
                await self._wait_for_disk(exc, deadline)
                continue
            if self._no_room is not None:
                logger.warning("spool %s: appending again", self.config.directory)
                self._no_room = None
            self._changed_now()
            return "spooled"

    async def _shed(self, batches: Sequence[Batch], records: int) -> Outcome | None:
        """Apply a shedding ``when_full`` policy (counted); None for ``block``."""
        policy = self.config.when_full
        if policy == "drop_newest":
            self.counters.dropped_batches += len(batches)
            self.counters.dropped_records += records
            return "dropped"
        if policy == "dead_letter":
            assert self._dead_letter is not None
            for shed in batches:
                try:
                    await self._dead_letter(shed, "spool_full")
                except CannotDeadLetter:
                    self.counters.dropped_batches += 1
                    self.counters.dropped_records += len(shed)
                else:
                    self.counters.dead_lettered_batches += 1
                    self.counters.dead_lettered_records += len(shed)
            return "dead_lettered"
        return None

    async def _write(
        self, buffers: Sequence[bytes | memoryview], records: int, batches: int
    ) -> None:
        async with self._lock:
            now = self._clock()
            written_ns = int(now * 1e9)
            size = HEADER.size + sum(memoryview(b).nbytes for b in buffers)
            try:
                entry = await self._append_frame(buffers, written_ns, size)
            except OSError as exc:
                # A full disk may be our own delivered last segment: free it, try once more.
                if exc.errno not in NO_ROOM or not self._log.retire_active():
                    raise
                entry = await self._append_frame(buffers, written_ns, size)
            self._records[entry.seq] = (records, batches)
            self._unsynced = True
            self.counters.appended_batches += batches
            self.counters.appended_records += records
            policy_sync = self.config.fsync
            if policy_sync == "batch" or (
                policy_sync == "interval" and now - self._last_sync >= self.config.fsync_interval
            ):
                # The frame is in the spool: sync it even if the caller was
                # cancelled meanwhile (a shutdown's cut while a worker thread
                # wrote it), so append returns "spooled" for what the spool
                # holds.  Raising Cancelled here had its records counted lost
                # (given up) though the next start delivers them.  The sync is
                # a local file call, waited for once started in any case.
                with trio.CancelScope(shield=True):
                    await self._sync_locked()

    async def _append_frame(
        self, buffers: Sequence[bytes | memoryview], written_ns: int, size: int
    ) -> Entry:
        """Write one frame: on the loop when small, or mid-size while writes are
        fast (see :data:`_INLINE_BYTES`); else in a worker thread."""
        log = self._log
        if log.rolls_next():
            return await trio.to_thread.run_sync(log.append, buffers, written_ns)
        if size <= _SMALL_BYTES:
            return log.append(buffers, written_ns)
        if size <= _INLINE_BYTES and not self._disk_slow:
            return self._timed_append(buffers, written_ns)
        return await trio.to_thread.run_sync(self._timed_append, buffers, written_ns)

    def _timed_append(self, buffers: Sequence[bytes | memoryview], written_ns: int) -> Entry:
        """``log.append``, noting whether it was slow (on the loop or in a thread)."""
        started = self._timer()
        entry = self._log.append(buffers, written_ns)
        self._disk_slow = self._timer() - started > _SLOW_WRITE_S
        return entry

    def _note_no_room(self, exc: OSError) -> None:
        self.counters.disk_full_errors += 1
        if self._no_room is None:
            logger.warning(
                "spool %s: no room on disk (%s); when_full=%r applies until an append succeeds",
                self.config.directory,
                exc,
                self.config.when_full,
            )
        self._no_room = exc

    async def _wait_for_disk(self, error: OSError, deadline: float) -> None:
        """``block`` on a full disk: wait for an acknowledgement (which may
        delete a segment) or, at most :data:`_DISK_POLL` seconds, for room
        made by others; at ``deadline`` (``block_timeout``) raise :class:`SpoolFull`."""
        started = trio.current_time()
        if started >= deadline or self._stalled:
            self._stalled = True
            raise SpoolFull(
                f"spool {self.config.directory}: no room on disk ({error}) for "
                f"{self.block_timeout} s (when_full='block')"
            )
        try:
            with trio.move_on_at(min(deadline, started + _DISK_POLL)):
                await self._changed.wait()
        finally:
            self.counters.blocked_seconds += trio.current_time() - started

    def use_blocking_budget(self, seconds: float) -> None:
        """Wait at most ``seconds`` for room when ``block_timeout`` is unset (the
        runtime's ``max_block``: the capture blocking budget bounds the wait)."""
        self._budget = seconds

    @property
    def block_timeout(self) -> float:
        """How long a ``block`` waits for room: ``config.block_timeout`` if set,
        else the producer's blocking budget if one was given, else for ever."""
        if self.config.block_timeout is not None:
            return self.config.block_timeout
        return math.inf if self._budget is None else self._budget

    async def _wait_for_room(self, size: int) -> None:
        started = trio.current_time()
        deadline = started if self._stalled else started + self.block_timeout
        try:
            with trio.move_on_at(deadline):
                while not self._has_room(size):
                    await self._changed.wait()
                return
            self._stalled = True
            raise SpoolFull(
                f"spool {self.config.directory}: {self._log.unacked_bytes} of "
                f"{self.config.quota_bytes} quota bytes unacknowledged for "
                f"{self.block_timeout} s (when_full='block')"
            )
        finally:
            self.counters.blocked_seconds += trio.current_time() - started

    def first(self) -> Entry | None:
        """The oldest unacknowledged frame, if any."""
        return self._log.entries[0] if self._log.entries else None

    async def wait_changed(self) -> None:
        """Return at the next append or ack (or :meth:`wake`)."""
        await self._changed.wait()

    def wake(self) -> None:
        """Wake :meth:`wait_changed` now: its owner latched a failure to see."""
        self._changed_now()

    async def wait_nonempty(self) -> None:
        """Return once the spool holds an unacknowledged frame."""
        while not self._log.entries:
            await self._changed.wait()

    async def read(self, entry: Entry) -> Spooled:
        """The batches of ``entry``, decoded from disk."""
        async with self._reading:
            body = await trio.to_thread.run_sync(self._log.read, entry)
        batches, token = decode(body, self._hooks)
        records = sum(len(b) for b in batches)
        self._records.setdefault(entry.seq, (records, len(batches)))
        return Spooled(entry.seq, tuple(batches), token or self.token(entry.seq), records)

    async def read_group(self, max_bytes: int) -> Spooled:
        """The oldest unacknowledged frames as one group to insert together:
        consecutive frames up to ``max_bytes`` (at least one), ending before
        a frame whose token was fixed before spooling (that one goes alone).

        Every group is recorded (``intent``) before it is returned, and after
        a restart the first group is exactly the one a previous run recorded
        and had not acknowledged: its token (``spool-<id>-<first>-<last>``,
        or the frame's own) then names the same rows, so a repeat is
        recognised.
        """
        log = self._log
        entries: list[Entry] = []
        size = 0
        # Under the writers' lock: an append in a worker thread adds to
        # ``log.entries``, which must not change while it is iterated here.
        async with self._lock:
            intent = log.intent
            for entry in log.entries:
                if intent is not None:
                    if entry.seq > intent[1]:
                        break
                elif entries and (size + entry.size > max_bytes or len(entries) >= _GROUP_FRAMES):
                    break
                entries.append(entry)
                size += entry.size
        if not entries:
            raise LookupError("read_group() of an empty spool")
        async with self._reading:
            bodies = await trio.to_thread.run_sync(log.read_many, entries)
        batches: list[Batch] = []
        token: str | None = None
        taken = 0
        for i, body in enumerate(bodies):
            frame, fixed = decode(body, self._hooks)
            if fixed is not None and i > 0 and intent is None:
                break  # a frame with its own token goes alone, next time
            batches.extend(frame)
            records = sum(len(b) for b in frame)
            self._records.setdefault(entries[i].seq, (records, len(frame)))
            taken += 1
            token = fixed
            if fixed is not None:
                break
        first, last = entries[0].seq, entries[taken - 1].seq
        single = token or self.token(first)
        token = single if taken == 1 else f"spool-{log.spool_id}-{first}-{last}"
        if intent is None:  # durable with its frames before the insert (a thread trip)
            # Under the writers' lock: ``intend`` fsyncs the active segment,
            # which an append rolling (or retiring) it would close meanwhile.
            async with self._lock:
                await trio.to_thread.run_sync(log.intend, first, last)
        return Spooled(last, tuple(batches), token, sum(len(b) for b in batches), first)

    @property
    def delivered_pieces(self) -> frozenset[str]:
        """Tokens of the parts of the group being delivered (the last
        :meth:`read_group`'s) already delivered, by this run or the one
        before a restart (:meth:`note_piece`)."""
        return frozenset(self._log.pieces)

    async def note_piece(self, token: str) -> None:
        """Record, durably, that the part of the group being delivered
        inserted under ``token`` was delivered: a restart skips it (its
        repeat could come after enough other parts to be out of the
        deduplication window)."""
        async with self._lock:
            await trio.to_thread.run_sync(self._log.note_piece, token)

    async def ack(self, seq: int) -> None:
        """``seq`` and everything before it left the spool (delivered or given up on)."""
        async with self._lock:
            done = self._log.ack(seq)
            self._unsynced = True
        for entry in done:
            records, batches = self._records.pop(entry.seq, (0, 0))
            self.counters.acked_batches += batches
            self.counters.acked_bytes += entry.size
            self.counters.acked_records += records
        self._changed_now()

    async def _sync_locked(self) -> None:
        if not self._unsynced:
            return  # nothing appended or acknowledged since the last sync: no thread trip
        self._unsynced = False
        await trio.to_thread.run_sync(self._log.sync)
        self._last_sync = self._clock()

    async def check_writes(self) -> None:
        """Make, write, fsync and remove a small file in the spool's directory
        (in a worker thread): raises the ``OSError`` its disk gives
        (:func:`~.files.check_writes`)."""
        await trio.to_thread.run_sync(check_writes, self.config.directory)

    async def sync(self) -> None:
        """fsync appended frames, the ack position and new file names."""
        async with self._lock:
            await self._sync_locked()

    def snapshot(self) -> SpoolCounters:
        """A detached copy of the counters, with the current holdings."""
        first = self.first()
        age = 0.0 if first is None else max(0.0, self._clock() - first.written_ns / 1e9)
        return attrs.evolve(
            self.counters,
            bytes=self._log.unacked_bytes,
            segments=self._log.segment_count,
            frames=len(self._log.entries),
            oldest_unacked_age_s=age,
        )

    async def aclose(self) -> None:
        """Sync and close the files (once a read in a worker thread is done)."""
        async with self._lock, self._reading:
            await trio.to_thread.run_sync(self._log.close)


__all__ = [
    "CannotDeadLetter",
    "DeadLetter",
    "Outcome",
    "Spool",
    "SpoolCounters",
    "SpoolFull",
    "Spooled",
]
