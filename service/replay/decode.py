"""Stored raw rows back into the records live routing handed processors.

The inverse of the ClickHouse sink's raw tables: descriptor columns become
the descriptor array; the layout's columns become one payload buffer laid out
exactly as a hook produced it.  Column by column, no per-record Python; a
layout of one variable-length array column reuses Arrow's value buffer as the
payload without copying.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from taproute.native import make_descriptors
from taproute.routing.batch import RecordBatch
from taproute.routing.layout import Column, Layout
from taproute.service.replay.errors import LayoutMismatch

#: The descriptor columns every raw table starts with.
DESCRIPTOR_NAMES = ("hook", "output_id", "key", "step", "seq", "timestamp")


def _numpy(column: pa.ChunkedArray | pa.Array) -> npt.NDArray[np.generic]:
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    return np.asarray(column.to_numpy(zero_copy_only=False))


def _list_values(
    table: pa.Table, column: Column, where: str
) -> tuple[npt.NDArray[np.generic], npt.NDArray[np.int64]]:
    """(flat values, per-row element counts) of an ``Array(T)`` column."""
    chunked = table.column(column.name)
    array = chunked.combine_chunks() if isinstance(chunked, pa.ChunkedArray) else chunked
    if not pa.types.is_list(array.type) and not pa.types.is_large_list(array.type):
        raise LayoutMismatch(
            f"{where}: column {column.name!r} expected {column.type}, found Arrow {array.type}"
        )
    counts = np.asarray(pc.list_value_length(array).fill_null(0).to_numpy(), dtype=np.int64)
    flat = array.flatten()
    values = np.asarray(flat.to_numpy(zero_copy_only=False))
    if values.dtype != column.element_dtype:
        values = values.astype(column.element_dtype)
    return values, counts


def _check_width(counts: npt.NDArray[np.int64], column: Column, where: str) -> None:
    """Every row of a fixed-shape array column holds exactly its shape's values."""
    width = int(np.prod(column.shape))
    if len(counts) and bool(np.any(counts != width)):
        bad = int(np.flatnonzero(counts != width)[0])
        raise LayoutMismatch(
            f"{where}: row {bad}, column {column.name!r} has {int(counts[bad])} "
            f"values, layout shape {column.shape} needs {width}"
        )


def _fixed_rows(table: pa.Table, columns: tuple[Column, ...], where: str) -> npt.NDArray[np.void]:
    """The fixed-size columns as one packed structured array."""
    n = table.num_rows
    rows = np.empty(n, dtype=np.dtype([(c.name, c.dtype) for c in columns]))
    for column in columns:
        if column.is_array:
            values, counts = _list_values(table, column, where)
            _check_width(counts, column, where)
            rows[column.name] = values.reshape(n, *column.shape)
        else:
            rows[column.name] = _numpy(table.column(column.name)).astype(column.dtype)
    return rows


def decode_records(
    table: pa.Table,
    layout: Layout,
    layout_id: int,
    hook_names: list[str],
    *,
    where: str,
) -> RecordBatch:
    """``table`` (a raw table's rows) as a :class:`RecordBatch` of ``layout``.

    ``hook_names`` is the replay's hook registry in output_id order: each
    record's ``output_id`` becomes the index of its hook there.
    """
    n = table.num_rows
    hooks = table.column("hook")
    if pa.types.is_dictionary(hooks.type):
        hooks = hooks.cast(pa.string())
    ids = pc.index_in(hooks, value_set=pa.array(hook_names, pa.string()))
    output_ids = np.asarray(ids.to_numpy(zero_copy_only=False))
    if n and ids.null_count:
        raise LayoutMismatch(f"{where}: a record's hook is not in the replay's hook list")
    timestamps = (
        table.column("timestamp").cast(pa.timestamp("ns")).cast(pa.int64()).to_numpy()
        if n
        else np.zeros(0, np.int64)
    )
    common = {
        "layout_ids": layout_id,
        "keys": _numpy(table.column("key")),
        "steps": _numpy(table.column("step")),
        "seqs": _numpy(table.column("seq")),
        "timestamps_ns": timestamps,
    }
    if layout.is_fixed and len(layout.columns) == 1 and layout.columns[0].is_array:
        # One fixed-shape array column: the payload is Arrow's value buffer as is.
        column = layout.columns[0]
        values, counts = _list_values(table, column, where)
        _check_width(counts, column, where)
        size = layout.dtype.itemsize
        desc = make_descriptors(output_ids, size, count=n, **common)
        return RecordBatch.from_buffer(desc, np.ascontiguousarray(values).view(np.uint8))
    if layout.is_fixed:
        rows = _fixed_rows(table, layout.columns, where)
        size = rows.dtype.itemsize
        desc = make_descriptors(output_ids, size, count=n, **common)
        return RecordBatch.from_buffer(desc, rows.view(np.uint8).reshape(-1))
    tail = layout.tail
    assert tail is not None
    values, counts = _list_values(table, tail, where)
    element = tail.element_dtype.itemsize
    prefix = layout.prefix_size
    lengths = prefix + counts * element
    if prefix == 0:  # the tail is the whole payload: Arrow's buffer as is
        desc = make_descriptors(output_ids, lengths, count=n, **common)
        return RecordBatch.from_buffer(desc, np.ascontiguousarray(values).view(np.uint8))
    head = _fixed_rows(table, layout.fixed_columns, where).view(np.uint8).reshape(n, prefix)
    offsets = np.zeros(n, dtype=np.int64)
    np.cumsum(lengths[:-1], out=offsets[1:])
    payload = np.empty(int(lengths.sum()), dtype=np.uint8)
    payload[offsets[:, None] + np.arange(prefix)] = head
    sizes = counts * element
    total = int(sizes.sum())
    if total:
        starts = offsets + prefix
        index = np.repeat(starts - np.concatenate(([0], np.cumsum(sizes)[:-1])), sizes)
        payload[index + np.arange(total)] = np.ascontiguousarray(values).view(np.uint8)
    desc = make_descriptors(output_ids, lengths, count=n, offsets=offsets, **common)
    return RecordBatch.from_buffer(desc, payload)
