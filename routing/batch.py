"""RecordBatch: descriptors plus one shared, read-only payload buffer.

A batch is immutable.  Every route and destination that a batch reaches gets
the *same* object (or a :meth:`RecordBatch.select` of it that shares the same
buffer and lease); nobody copies payload bytes to forward them.  The
producer's release callback runs once, when the last holder is done.  A
batch merged from several (its payload one view over their buffers) knows
which buffer each record lies in, so a selection of it holds only those.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from taproute.native import DESCRIPTOR_DTYPE, BufferLease, PartsLease
from taproute.routing.errors import RecordError

Descriptors = npt.NDArray[np.void]
Payload = npt.NDArray[np.uint8]


def readonly_bytes(buffer: Any) -> Payload:
    """A read-only ``uint8`` view of any buffer-protocol object, without copying."""
    if isinstance(buffer, np.ndarray):
        if not buffer.flags.c_contiguous:
            raise RecordError("payload array must be C-contiguous (a copy would be silent)")
        view = buffer.reshape(-1).view(np.uint8)
    else:
        try:
            raw = memoryview(buffer)
        except TypeError:
            raise RecordError(
                "payload must be bytes-like (bytes, bytearray, memoryview or a numpy array), "
                f"found {type(buffer).__name__}"
            ) from None
        view = np.frombuffer(raw.cast("B"), dtype=np.uint8)
    if view.flags.writeable:
        view = view.view()
        view.flags.writeable = False
    return view


def checked_release(release: Any) -> Callable[[], object] | None:
    """``release`` if it can be called (or is None); else refused here, where the
    producer hands it in, not when the last holder returns the buffer (that
    call raised on the loop and latched the router's failure)."""
    if release is None or callable(release):
        return release  # type: ignore[no-any-return]
    raise RecordError(
        "release must be callable (called once, with no arguments, when the buffer "
        f"is free again) or None, found {type(release).__name__} {release!r:.60}"
    )


def readonly_descriptors(value: Any) -> Descriptors:
    """``value`` as a read-only descriptor array (a view; raises if it is not one)."""
    if not isinstance(value, np.ndarray) or value.dtype != DESCRIPTOR_DTYPE or value.ndim != 1:
        raise RecordError(
            "descriptors must be a 1-D numpy array of taproute.native.DESCRIPTOR_DTYPE "
            "(see make_descriptors)"
        )
    descriptors: Descriptors = value
    if descriptors.flags.writeable:
        descriptors = descriptors.view()
        descriptors.flags.writeable = False
    return descriptors


def taken_descriptors(value: Any) -> Descriptors:
    """A producer's descriptors, copied into a read-only array of the batch's own.

    The producer keeps its array (and may fill it for its next batch at once);
    a view would let that rewrite records already accepted, past the checks
    they were accepted under.  56 bytes a record, C-contiguous (a strided view
    is taken as its records).
    """
    copied: Descriptors = np.array(readonly_descriptors(value), order="C", copy=True)
    copied.flags.writeable = False
    return copied


class Retained:
    """A hold on a batch's buffer taken by a sink that keeps the batch past ``submit``."""

    __slots__ = ("_lease",)

    def __init__(self, lease: BufferLease) -> None:
        lease.acquire()
        self._lease: BufferLease | None = lease

    def release(self) -> None:
        """Give the hold back (idempotent)."""
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.release()


@attrs.frozen(eq=False)
class Lineage:
    """Where a batch's derived records come from: per record its root (the id
    of the captured record its chain started from) and its depth (>= 1).
    Columns, not per-record objects; captured batches carry none (depth 0,
    each record its own root)."""

    roots: npt.NDArray[np.int64]
    depths: npt.NDArray[np.int32]

    def select(self, selection: npt.NDArray[np.intp]) -> Lineage:
        """The lineage of the records at ``selection``."""
        return Lineage(self.roots[selection], self.depths[selection])


@attrs.frozen(eq=False)
class RecordBatch:
    """An immutable batch of records sharing one payload buffer.

    Build one with :meth:`from_buffer`; the lease starts with one holder, the
    submitter, who releases it when done handing the batch on.
    """

    descriptors: Descriptors = attrs.field(converter=readonly_descriptors)
    payload: Payload
    lease: BufferLease = attrs.field(factory=BufferLease)
    #: Payload bytes the records of this batch cover (computed once if not given).
    nbytes: int = attrs.field()

    #: Derived records' roots and depths (None: captured records, depth 0).
    lineage: Lineage | None = attrs.field(default=None, kw_only=True)

    #: The dtype of the numpy array the producer handed to :meth:`from_buffer`
    #: (None: raw bytes), checked against the records' layouts at submit.
    source_dtype: np.dtype[Any] | None = attrs.field(default=None, kw_only=True, eq=False)

    #: A merged batch's (its ``lease`` a :class:`~taproute.native.PartsLease`):
    #: per record, which of the merged buffers its payload lies in (an int32
    #: index into the lease's).  None: the lease holds the whole buffer.
    parts: npt.NDArray[np.int32] | None = attrs.field(default=None, kw_only=True, eq=False)

    @nbytes.default
    def _sum_lengths(self) -> int:
        return int(self.descriptors["length"].sum())

    @classmethod
    def from_buffer(
        cls,
        descriptors: Descriptors,
        payload: Any,
        release: Callable[[], object] | None = None,
    ) -> RecordBatch:
        """Wrap ``payload`` (any buffer) without copying; ``release`` runs once at the end.

        ``descriptors`` are copied (small): the caller may reuse its array at once.

        A numpy array's dtype is kept, so that submitting the batch checks it
        against the records' layouts (:mod:`taproute.routing.payload_dtypes`)."""
        dtype = payload.dtype if isinstance(payload, np.ndarray) else None
        return cls(
            taken_descriptors(descriptors),
            readonly_bytes(payload),
            BufferLease(checked_release(release)),
            source_dtype=dtype,
        )

    def __len__(self) -> int:
        return len(self.descriptors)

    def select(self, selection: npt.NDArray[np.intp] | None) -> RecordBatch:
        """The records at ``selection`` (``None``: this batch itself).

        The result shares this batch's payload buffer and lease; only the
        (small) descriptor array is new.  Of a merged batch, it shares the
        payload and has a lease of its own over the buffers its records lie
        in (found in one native pass), so whoever keeps it keeps only those.
        """
        if selection is None:
            return self
        lineage = None if self.lineage is None else self.lineage.select(selection)
        lease, parts = self.lease, self.parts
        if parts is not None and isinstance(lease, PartsLease):
            parts = parts[selection]
            lease = lease.over(parts)
        return RecordBatch(
            self.descriptors[selection], self.payload, lease, lineage=lineage, parts=parts
        )

    def payload_of(self, index: int) -> Payload:
        """The read-only payload bytes of record ``index`` (a view, not a copy)."""
        d = self.descriptors[index]
        start = int(d["offset"])
        return self.payload[start : start + int(d["length"])]

    def retain(self) -> Retained:
        """Hold the buffer past ``submit`` (a sink that keeps the batch calls this)."""
        return Retained(self.lease)


@attrs.frozen(eq=False)
class RowBatch:
    """Rows a processor produced: a structured array of an output layout.

    Unlike a :class:`RecordBatch` it owns its memory (the processor allocated
    it), so there is no lease.  ``route`` names the route that produced it.
    """

    route: str
    layout_name: str
    rows: npt.NDArray[np.void]

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def nbytes(self) -> int:
        """Bytes of the row array (object columns count their pointers only)."""
        return int(self.rows.nbytes)


#: What a destination's ``submit`` receives.
Batch = RecordBatch | RowBatch
