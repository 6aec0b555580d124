"""Records: the read-only view of its input that a processor receives."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from taproute.native import DESCRIPTOR_DTYPE, back_to_back
from taproute.routing.batch import Descriptors, RecordBatch
from taproute.routing.errors import RecordError
from taproute.routing.layout import Column, Layout


class Records:
    """The records one route hands one processor call, read through one layout.

    Nothing here copies unless it says so: :meth:`rows` and :meth:`tail` are
    views when the payload allows; every array is read-only.
    """

    __slots__ = ("_batch", "_hook_name", "layout")

    def __init__(
        self, batch: RecordBatch, layout: Layout, hook_name: Callable[[int], str] | None = None
    ) -> None:
        self._batch = batch
        self.layout = layout
        self._hook_name = hook_name

    def hook_name(self, index: int) -> str:
        """The hook name record ``index`` was captured under."""
        if self._hook_name is None:
            raise LookupError("these records come without hook names")
        return self._hook_name(int(self._batch.descriptors["output_id"][index]))

    def __len__(self) -> int:
        return len(self._batch)

    @property
    def batch(self) -> RecordBatch:
        """The underlying (shared, immutable) batch."""
        return self._batch

    @property
    def descriptors(self) -> Descriptors:
        """One descriptor per record (read-only)."""
        return self._batch.descriptors

    def rows(self) -> npt.NDArray[np.void]:
        """All records as one structured array of the layout's dtype.

        Fixed layouts only.  A zero-copy view when the records lie back to
        back in the buffer (the usual case for one hook's batch), otherwise a
        vectorised gather (one copy, no per-record Python).
        """
        layout = self.layout
        if not layout.is_fixed:
            raise RecordError(
                f"layout {layout.name!r} has a variable-length column; use tail()/tails()"
            )
        return self._gather(layout.dtype, layout.dtype.itemsize, 0)

    def tail(self, index: int) -> npt.NDArray[np.generic]:
        """The variable-length trailing array of record ``index`` (a read-only view)."""
        column = self._tail_column()
        raw = self._batch.payload_of(index)[self.layout.prefix_size :]
        return raw.view(column.element_dtype)

    def tails(self) -> npt.NDArray[np.generic]:
        """Every record's trailing array stacked into one 2-D array.

        All records must have the same tail length; a view when they lie back
        to back, else one vectorised gather.
        """
        column = self._tail_column()
        lengths = self.descriptors["length"]
        if len(lengths) == 0:
            return np.empty((0, 0), dtype=column.element_dtype)
        if np.any(lengths != lengths[0]):
            raise RecordError(
                f"layout {self.layout.name!r}: tails() needs equal payload lengths, "
                f"got {int(lengths.min())}..{int(lengths.max())} bytes; use tail(i)"
            )
        prefix = self.layout.prefix_size
        width = int(lengths[0]) - prefix
        count = width // column.element_dtype.itemsize
        dtype = np.dtype((column.element_dtype, (count,)))
        return self._gather(dtype, int(lengths[0]), prefix)

    def _tail_column(self) -> Column:
        column = self.layout.tail
        if column is None:
            raise RecordError(f"layout {self.layout.name!r} is fixed; use rows()")
        return column

    def _gather(self, dtype: np.dtype[np.generic], stride: int, skip: int) -> npt.NDArray[np.void]:
        desc = self.descriptors
        payload = self._batch.payload
        n = len(desc)
        if n == 0:
            return np.empty(0, dtype=dtype)
        offsets = desc["offset"]
        first = int(offsets[0])
        if desc.flags.c_contiguous and desc.dtype == DESCRIPTOR_DTYPE:
            contiguous = back_to_back(desc, stride)  # one C pass
        else:
            contiguous = (n == 1 or bool(np.all(np.diff(offsets) == stride))) and bool(
                np.all(desc["length"] == stride)
            )
        if contiguous:
            view = np.ndarray(
                shape=(n,), dtype=dtype, buffer=payload, offset=first + skip, strides=(stride,)
            )
            view.flags.writeable = False
            return view
        # One row-sized copy per record: index a view that starts a row at
        # every byte of the buffer (rows overlap; only the indexed ones are
        # read).  Far cheaper than a byte-by-byte gather of n x itemsize.
        starts = offsets + skip
        size, width = len(payload), dtype.itemsize
        low, high = int(starts.min()), int(starts.max())
        if low < 0 or high + width > size:
            bad = int(np.flatnonzero((starts < 0) | (starts + width > size))[0])
            raise RecordError(
                f"record {bad}: {width} bytes at offset {int(starts[bad])} lie outside "
                f"the {size}-byte payload buffer"
            )
        rows = np.ndarray(
            shape=(high - low + 1,), dtype=dtype, buffer=payload, offset=low, strides=(1,)
        )
        gathered: npt.NDArray[np.void] = rows[starts - low]
        gathered.flags.writeable = False
        return gathered
