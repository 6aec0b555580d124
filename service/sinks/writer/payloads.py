"""What crosses to the writer process for a batch: its descriptors (raw
records) or rows, checked against the layouts the sink writes, and a
reference to its payload in the :class:`~.shared_pool.SharedBufferPool`
(where the capture hook wrote it, or one copy into the pool), with the hold
that keeps the payload in place until the writer is done."""

from __future__ import annotations

from typing import Any

import numpy as np

from taproute.routing.batch import Batch, RowBatch
from taproute.routing.errors import ConfigError
from taproute.routing.schema import RecordSchema
from taproute.service.sinks.writer.blocks import WriterCounters
from taproute.service.sinks.writer.protocol import RawItem, RowItem
from taproute.service.sinks.writer.shared_pool import SharedBufferPool


class Release:
    """A hold on a pool buffer the sink copied a payload into."""

    __slots__ = ("_array", "_pool")

    def __init__(self, pool: SharedBufferPool, array: Any) -> None:
        self._pool, self._array = pool, array

    def release(self) -> None:
        array, self._array = self._array, None
        if array is not None:
            self._pool.give_back(array)


def batch_item(
    batch: Batch,
    *,
    pool: SharedBufferPool,
    schema: RecordSchema,
    raw_ids: frozenset[int],
    row_layouts: frozenset[str],
    counters: WriterCounters,
) -> tuple[RawItem | RowItem, Any]:
    """What crosses to the writer for ``batch`` (checked), and the hold that
    keeps its payload in place until the writer is done."""
    if isinstance(batch, RowBatch):
        if batch.layout_name not in row_layouts:
            raise ConfigError(
                f"WriterProcessSink got rows of layout {batch.layout_name!r} from route "
                f"{batch.route!r}; it writes rows of {sorted(row_layouts)}"
            )
        return RowItem(batch.route, batch.layout_name, batch.rows), None
    layout_ids = batch.descriptors["layout_id"]
    first = int(layout_ids[0])
    found = {first} if bool(np.all(layout_ids == first)) else set(np.unique(layout_ids).tolist())
    if not found <= raw_ids:
        bad = sorted(schema.by_id(i).name for i in found - raw_ids)
        raise ConfigError(
            f"WriterProcessSink got raw records of layout(s) {bad}; it writes raw "
            f"{sorted(schema.by_id(i).name for i in raw_ids)}"
        )
    payload = batch.payload
    ref = pool.locate(payload)
    if ref is not None:
        # The bytes its records cover: a merged batch's payload is a view
        # spanning other parts' buffers and pool padding between them.
        counters.shared_bytes += batch.nbytes
        hold: Any = batch.retain()
    else:  # not in shared memory: one copy into it
        staging = pool.take_array(payload.nbytes)[: payload.nbytes]
        staging[:] = payload
        ref = pool.locate(staging)
        assert ref is not None
        counters.copied_bytes += payload.nbytes
        hold = Release(pool, staging)
    return RawItem(ref.segment, ref.offset, payload.nbytes, batch.descriptors), hold
