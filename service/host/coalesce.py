"""Single records coalesced into one batch: what ``submit`` queues (a row of
descriptor fields and its payload bytes) becomes one :class:`RecordBatch`,
its payloads laid back to back, when the ingress seals them."""

from __future__ import annotations

import numpy as np

from taproute.native import DESCRIPTOR_DTYPE
from taproute.routing.batch import RecordBatch

#: Descriptor fields a single-record submit provides (offset/length come at seal time).
_ROW_DTYPE = np.dtype(
    [
        (name, DESCRIPTOR_DTYPE.fields[name][0])  # type: ignore[index]
        for name in ("output_id", "layout_id", "flags", "key", "step", "seq", "timestamp_ns")
    ]
)


def coalesce(rows: list[tuple[int, ...]], payloads: list[bytes]) -> RecordBatch:
    """One batch of the records ``rows`` (fields in :data:`_ROW_DTYPE` order)
    with ``payloads`` (one per row, non-empty list), offsets and lengths filled."""
    desc = np.array(rows, dtype=_ROW_DTYPE)
    full = np.empty(len(rows), dtype=DESCRIPTOR_DTYPE)
    for name in _ROW_DTYPE.names or ():
        full[name] = desc[name]
    lengths = np.fromiter((len(p) for p in payloads), dtype=np.int64, count=len(payloads))
    full["length"] = lengths
    full["offset"][0] = 0
    np.cumsum(lengths[:-1], out=full["offset"][1:])
    return RecordBatch.from_buffer(full, b"".join(payloads))
