"""CaptureSink: a destination that keeps everything it receives.

For tests and notebooks.  It holds the buffers of the raw batches it keeps
(the producer does not get them back) until :meth:`CaptureSink.clear`.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from taproute.native import DESCRIPTOR_DTYPE
from taproute.routing.batch import Batch, RecordBatch, Retained, RowBatch
from taproute.routing.errors import SinkClosed


class CaptureSink:
    """Keeps every batch, in arrival order, as the very objects it was given."""

    def __init__(self) -> None:
        self.batches: list[Batch] = []
        self.flushes = 0
        self.closed = False
        self._holds: list[Retained] = []

    async def submit(self, batch: Batch) -> None:
        """Keep ``batch`` (holding its buffer if it is raw)."""
        if self.closed:
            raise SinkClosed("CaptureSink is closed")
        if isinstance(batch, RecordBatch):
            self._holds.append(batch.retain())
        self.batches.append(batch)

    async def flush(self) -> None:
        """Nothing to write; counts the call."""
        self.flushes += 1

    async def close(self) -> None:
        """Refuse further batches; what was captured stays readable."""
        self.closed = True

    def clear(self) -> None:
        """Forget every batch and give every held buffer back."""
        holds, self._holds = self._holds, []
        self.batches = []
        for hold in holds:
            hold.release()

    @property
    def record_batches(self) -> list[RecordBatch]:
        """The raw batches received (forwarded or unmatched)."""
        return [b for b in self.batches if isinstance(b, RecordBatch)]

    def row_batches(self, route: str | None = None) -> list[RowBatch]:
        """The processed batches received, optionally from one route only."""
        return [
            b
            for b in self.batches
            if isinstance(b, RowBatch) and (route is None or b.route == route)
        ]

    def rows(self, route: str) -> npt.NDArray[np.void]:
        """Every row ``route`` emitted here, concatenated in arrival order."""
        parts = [b.rows for b in self.row_batches(route)]
        if not parts:
            raise KeyError(f"no rows from route {route!r} were captured")
        return np.concatenate(parts)

    @property
    def records(self) -> int:
        """Raw records received."""
        return sum(len(b) for b in self.record_batches)

    def descriptors(self) -> npt.NDArray[np.void]:
        """Descriptors of every raw record received, in arrival order."""
        parts = [b.descriptors for b in self.record_batches]
        return np.concatenate(parts) if parts else np.empty(0, dtype=DESCRIPTOR_DTYPE)
