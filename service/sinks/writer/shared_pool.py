"""Host buffers in shared memory, so a writer process reads payloads where
the capture hook wrote them.

:class:`SharedBufferPool` hands out buffers like
:class:`~taproute.service.capture.pool.HostBufferPool` (``take`` /
``give_back``, power-of-two size classes from 4 KiB, reused, thread-safe),
but carves them out of anonymous shared-memory segments (Linux
``memfd_create``).  A segment has no name in any file system: its file
descriptor is handed to the writer process over a Unix socket
(``SCM_RIGHTS``), and the memory is gone once the last process holding it
unmaps it, so neither a clean shutdown nor a SIGKILL of either process can
leave a segment behind.  Pages are allocated by the kernel when first
touched: a segment's size is address space, not memory.

:meth:`SharedBufferPool.locate` says whether an array lies in one of the
pool's segments and where (segment id, offset): what crosses the process
boundary instead of the bytes.
"""

from __future__ import annotations

import bisect
import contextlib
import mmap
import os
import threading
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import attrs
import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    import torch

#: Default size of one shared segment (address space; pages are touched lazily).
SEGMENT_BYTES = 64 * 2**20


class SharedPoolClosed(RuntimeError):
    """The pool's segments were released; it hands out no more buffers."""


@attrs.frozen
class SegmentRef:
    """Where an array lies in a pool: its segment, and its offset there."""

    segment: int
    offset: int


class _Segment:
    __slots__ = ("array", "base", "fd", "id", "map", "size", "used")

    def __init__(self, segment_id: int, size: int) -> None:
        self.id = segment_id
        self.size = size
        self.fd = os.memfd_create(f"taproute-writer-{segment_id}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self.map = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        self.array: npt.NDArray[np.uint8] = np.frombuffer(self.map, dtype=np.uint8)
        self.base = int(self.array.__array_interface__["data"][0])
        self.used = 0


class Span(NamedTuple):
    """A run of ``members`` consecutive payloads and one view covering them
    (None: a run of one, taken as it is), with where each starts in it."""

    members: int
    view: npt.NDArray[np.uint8] | None
    starts: list[int]


def _span(segment: _Segment, starts: list[int], end: int) -> Span:
    """The run of arrays at ``starts`` (up to ``end``) of ``segment``."""
    if len(starts) == 1:
        return Span(1, None, [0])
    first = min(starts)
    view = segment.array[first:end]
    view.flags.writeable = False
    return Span(len(starts), view, [start - first for start in starts])


def _size_class(nbytes: int) -> int:
    return 1 << max(12, (nbytes - 1).bit_length())  # powers of two from 4 KiB


class SharedBufferPool:
    """Reusable host buffers in shared-memory segments (see the module docstring).

    ``take`` returns a uint8 torch tensor (for capture hooks' device outputs:
    ``bind_modules(..., pool=sink.buffer_pool)``), ``take_array`` and
    ``take_host`` a numpy array (``take_host``, for capture hooks' CPU
    outputs, None once closed); all go back with ``give_back``.  Never pinned: page-locking
    shared memory for CUDA copies is not done yet (a device-to-host copy into
    it is synchronous, still correct).
    """

    #: Capture hooks copy CPU outputs into this pool too (a fresh array from
    #: the allocator would not be shared with the writer process).
    cpu_outputs = True
    #: Not page-locked (see the class docstring).
    pin = False

    def __init__(self, *, segment_bytes: int = SEGMENT_BYTES) -> None:
        if segment_bytes < 4096:
            raise ValueError(f"segment_bytes must be at least 4096, got {segment_bytes}")
        self.segment_bytes = segment_bytes
        self._lock = threading.Lock()
        self._segments: list[_Segment] = []
        self._bases: list[int] = []  # sorted segment base addresses, for locate()
        self._by_base: list[_Segment] = []
        self._free: dict[int, list[npt.NDArray[np.uint8]]] = defaultdict(list)
        # Tensors handed out by take() come back to their own free lists:
        # no address arithmetic on the hook's path.
        self._free_tensors: dict[int, list[Any]] = defaultdict(list)
        self._tensor_ids: set[int] = set()
        self._tensors: list[Any] = []
        self._closed = False
        self.allocated = 0
        self.outstanding = 0

    # -- handing buffers out -------------------------------------------------

    def take_array(self, nbytes: int) -> npt.NDArray[np.uint8]:
        """A free buffer of at least ``nbytes`` (a uint8 numpy array), now the caller's."""
        size = _size_class(nbytes)
        with self._lock:
            if self._closed:
                raise SharedPoolClosed("SharedBufferPool is closed")
            self.outstanding += 1
            free = self._free[size]
            if free:
                return free.pop()
            self.allocated += 1
            return self._carve(size)

    def take_host(self, nbytes: int) -> npt.NDArray[np.uint8] | None:
        """:meth:`take_array` for a capture hook: None once the pool is closed
        (the hook then gathers into a fresh, private array instead)."""
        size = _size_class(nbytes)
        with self._lock:
            if self._closed:
                return None
            self.outstanding += 1
            free = self._free[size]
            if free:
                return free.pop()
            self.allocated += 1
            return self._carve(size)

    def take(self, nbytes: int) -> torch.Tensor:
        """A free buffer of at least ``nbytes`` (a uint8 tensor), now the caller's.

        After :meth:`close`, a private (unshared) buffer, so a hook still
        bound to a closed pool keeps working (its records are copied by the
        sink, or refused by a closed runtime).
        """
        import torch

        size = _size_class(nbytes)
        with self._lock:
            free = self._free_tensors[size]
            if free and not self._closed:
                self.outstanding += 1
                reused: torch.Tensor = free.pop()
                return reused
        try:
            array = self.take_array(nbytes)
        except SharedPoolClosed:
            return torch.empty(size, dtype=torch.uint8)
        tensor = torch.from_numpy(array)
        with self._lock:
            self._tensors.append(tensor)
            self._tensor_ids.add(id(tensor))
        return tensor

    def give_back(self, buffer: Any) -> None:
        """Make ``buffer`` (from :meth:`take` or :meth:`take_array`) reusable."""
        with self._lock:
            if id(buffer) in self._tensor_ids:
                self.outstanding -= 1
                self._free_tensors[buffer.numel()].append(buffer)
                return
            if not isinstance(buffer, np.ndarray) or self.locate_unlocked(buffer) is None:
                return  # a private buffer handed out after close
            self.outstanding -= 1
            self._free[buffer.nbytes].append(buffer)

    def _carve(self, size: int) -> npt.NDArray[np.uint8]:
        """With the lock held: ``size`` bytes from the newest segment, or a new one."""
        segment = self._segments[-1] if self._segments else None
        if segment is None or segment.size - segment.used < size:
            segment = _Segment(len(self._segments), max(self.segment_bytes, size))
            self._segments.append(segment)
            at = bisect.bisect(self._bases, segment.base)
            self._bases.insert(at, segment.base)
            self._by_base.insert(at, segment)
        start = segment.used
        segment.used += size
        return segment.array[start : start + size]

    # -- where things are ------------------------------------------------------

    def locate(self, array: npt.NDArray[Any]) -> SegmentRef | None:
        """The segment and offset ``array`` lies at, or None if it is not wholly in one."""
        with self._lock:
            return self.locate_unlocked(array)

    def locate_unlocked(self, array: npt.NDArray[Any]) -> SegmentRef | None:
        """:meth:`locate` for a caller holding no lock (reads an append-only index)."""
        address = int(array.__array_interface__["data"][0])
        at = bisect.bisect(self._bases, address) - 1
        if at < 0:
            return None
        segment = self._by_base[at]
        offset = address - segment.base
        if offset + array.nbytes > segment.size:
            return None
        return SegmentRef(segment.id, offset)

    def spans(self, payloads: Sequence[npt.NDArray[np.uint8]]) -> list[Span]:
        """``payloads`` (1-D ``uint8`` arrays) cut into runs of consecutive
        arrays that lie in one segment, each run with one read-only view
        covering it and where each of its arrays starts in the view; an array
        in no segment, or alone in its run, is a run of one without a view.

        No byte is copied: a view is a slice of its segment, kept mapped
        while it is held.  What lets the runtime merge the captured batches
        of one wake-up (:mod:`taproute.service.host.batch_merge`).
        """
        runs: list[Span] = []
        with self._lock:
            bases, by_base = self._bases, self._by_base
            segment: _Segment | None = None
            starts: list[int] = []
            end = 0
            for payload in payloads:
                address = int(payload.__array_interface__["data"][0])
                at = bisect.bisect(bases, address) - 1
                found = by_base[at] if at >= 0 else None
                offset = 0 if found is None else address - found.base
                if found is not None and offset + payload.nbytes > found.size:
                    found = None
                if found is not segment or found is None:
                    if segment is not None:
                        runs.append(_span(segment, starts, end))
                    elif starts:
                        runs.append(Span(1, None, [0]))
                    segment, starts, end = found, [], 0
                starts.append(offset)
                end = max(end, offset + payload.nbytes)
            if segment is not None:
                runs.append(_span(segment, starts, end))
            elif starts:
                runs.append(Span(1, None, [0]))
        return runs

    def segment_fd(self, segment: int) -> tuple[int, int]:
        """The file descriptor and size of segment ``segment`` (to pass to a process)."""
        found = self._segments[segment]
        return found.fd, found.size

    @property
    def segments(self) -> int:
        """How many shared segments the pool has made."""
        return len(self._segments)

    def close(self) -> None:
        """Release the segments (idempotent).  Memory is freed once every
        process holding a mapping has dropped it; later ``take`` calls get
        private buffers."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            segments, self._segments = self._segments, []
            self._bases, self._by_base = [], []
            self._free.clear()
            self._free_tensors.clear()
            self._tensor_ids.clear()
            self._tensors.clear()
        for segment in segments:
            os.close(segment.fd)
            del segment.array  # the pool's own view; others may still hold theirs
            with contextlib.suppress(BufferError):  # views still out: unmapped with the last
                segment.map.close()


class SegmentViews:
    """The writer process's side: segments received by file descriptor, mapped
    read-only, and payload views into them."""

    def __init__(self) -> None:
        self._maps: dict[int, tuple[mmap.mmap, npt.NDArray[np.uint8]]] = {}

    def add(self, segment: int, fd: int, size: int) -> None:
        """Map segment ``segment`` from ``fd`` (closed here once mapped)."""
        try:
            mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        array = np.frombuffer(mapped, dtype=np.uint8)
        self._maps[segment] = (mapped, array)

    def __contains__(self, segment: int) -> bool:
        return segment in self._maps

    def view(self, segment: int, offset: int, length: int) -> npt.NDArray[np.uint8]:
        """A read-only view of ``length`` bytes at ``offset`` of ``segment``."""
        array = self._maps[segment][1]
        if offset < 0 or offset + length > len(array):
            raise ValueError(
                f"payload at {offset}+{length} lies outside shared segment {segment} "
                f"of {len(array)} bytes"
            )
        return array[offset : offset + length]
