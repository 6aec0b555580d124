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


def _values(
    array: pa.Array, dtype: np.dtype[np.generic], name: str, where: str
) -> npt.NDArray[np.generic]:
    """``array``'s values as ``dtype``.

    Arrow has no bfloat16: ClickHouse (chDB, and a server's Arrow output)
    hands a ``BFloat16`` value out as 2 bytes of binary, the value's own
    bytes, so a binary array whose every item is ``dtype``'s size is those
    values, read without a copy.
    """
    kind = array.type
    if pa.types.is_fixed_size_binary(kind):
        width = kind.byte_width
        if width != dtype.itemsize:
            raise LayoutMismatch(
                f"{where}: column {name!r} holds {width}-byte binary values, "
                f"expected {dtype.itemsize}-byte {dtype}"
            )
        data = np.frombuffer(array.buffers()[1], dtype=np.uint8)
        start = array.offset * width
        return data[start : start + len(array) * width].view(dtype)
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
        offset_type = np.int64 if pa.types.is_large_binary(kind) else np.int32
        offsets = np.frombuffer(array.buffers()[1], dtype=offset_type)
        offsets = offsets[array.offset : array.offset + len(array) + 1]
        sizes = np.diff(offsets)
        if len(sizes) and bool(np.any(sizes != dtype.itemsize)):
            bad = int(np.flatnonzero(sizes != dtype.itemsize)[0])
            raise LayoutMismatch(
                f"{where}: column {name!r} value {bad} is {int(sizes[bad])} bytes of binary, "
                f"expected one {dtype.itemsize}-byte {dtype}"
            )
        if not len(array):
            return np.zeros(0, dtype=dtype)
        data = np.frombuffer(array.buffers()[2], dtype=np.uint8)
        return data[int(offsets[0]) : int(offsets[-1])].view(dtype)
    values = np.asarray(array.to_numpy(zero_copy_only=False))
    if values.dtype != dtype:
        values = values.astype(dtype)
    return values


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
    values = _values(array.flatten(), column.element_dtype, column.name, where)
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
            chunked = table.column(column.name)
            array = chunked.combine_chunks() if isinstance(chunked, pa.ChunkedArray) else chunked
            rows[column.name] = _values(array, column.dtype, column.name, where)
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
