"""The record descriptor: one fixed numpy structured dtype for every record.

A batch's descriptors are one array of :data:`DESCRIPTOR_DTYPE`; the payload
bytes of record ``i`` are ``payload[offset[i] : offset[i] + length[i]]`` of the
batch's one shared buffer.
"""

from __future__ import annotations

import time

import numpy as np
import numpy.typing as npt

#: output_id: which hook produced the record (from ``bind_hook``);
#: layout_id: index of the payload's layout in the ``RecordSchema``;
#: flags: reserved, 0;
#: key: request / sequence id (stateful routes derive their key from it);
#: step: decode step or iteration; seq: producer sequence number;
#: timestamp_ns: capture time, ns since the epoch;
#: offset, length: the payload's byte range in the batch buffer.
DESCRIPTOR_DTYPE: np.dtype[np.void] = np.dtype(
    [
        ("output_id", "<u4"),
        ("layout_id", "<u2"),
        ("flags", "<u2"),
        ("key", "<i8"),
        ("step", "<i8"),
        ("seq", "<i8"),
        ("timestamp_ns", "<i8"),
        ("offset", "<i8"),
        ("length", "<i8"),
    ]
)

IntArrayLike = int | npt.ArrayLike


def make_descriptors(
    output_ids: IntArrayLike,
    lengths: IntArrayLike,
    *,
    count: int | None = None,
    offsets: IntArrayLike | None = None,
    layout_ids: IntArrayLike = 0,
    keys: IntArrayLike = 0,
    steps: IntArrayLike = 0,
    seqs: IntArrayLike | None = None,
    timestamps_ns: IntArrayLike | None = None,
) -> npt.NDArray[np.void]:
    """Build a descriptor array, broadcasting scalars.

    ``count`` is the number of records (inferred from the first array argument
    when omitted).  ``offsets`` default to payloads packed back to back in
    order; ``seqs`` default to ``0..count-1``; ``timestamps_ns`` to now.
    """
    if count is None:
        for value in (output_ids, lengths, keys, steps, layout_ids):
            if np.ndim(value) > 0:
                count = len(np.asarray(value))
                break
        else:
            count = 1
    desc = np.zeros(count, dtype=DESCRIPTOR_DTYPE)
    desc["output_id"] = output_ids
    desc["layout_id"] = layout_ids
    desc["length"] = lengths
    if offsets is None:
        lengths_arr = desc["length"]
        desc["offset"][1:] = np.cumsum(lengths_arr[:-1])
    else:
        desc["offset"] = offsets
    desc["key"] = keys
    desc["step"] = steps
    desc["seq"] = np.arange(count) if seqs is None else seqs
    desc["timestamp_ns"] = time.time_ns() if timestamps_ns is None else timestamps_ns
    return desc
