"""Batches to Arrow tables, column by column: no per-row Python.

Raw payload bytes are reinterpreted in place where the records lie back to
back (a view), or gathered with one vectorised index otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from taproute.native import gather_ranges
from taproute.routing.batch import Batch, RecordBatch, RowBatch
from taproute.routing.errors import ConfigError
from taproute.routing.hooks import HookRegistry
from taproute.routing.layout import Column, Layout
from taproute.routing.records import Records
from taproute.routing.schema import RecordSchema
from taproute.service.sinks.clickhouse.tables import TableSpec

#: A hook's per-position value shape (``HookRegistry.token_shape_of``).
TokenShapes = Callable[[int], tuple[int, ...] | None]

_BFLOAT16 = np.dtype("bfloat16")


def _arrow(values: npt.NDArray[np.generic]) -> pa.Array:
    """A numpy column as Arrow: zero-copy when it is contiguous and aligned
    (fields of packed rows may not be; Arrow consumers want aligned buffers).
    Arrow has no bfloat16: those values go as Float32, which is exact, and
    ClickHouse stores them back in its ``BFloat16`` column exactly."""
    if values.dtype == _BFLOAT16:
        values = values.astype(np.float32)
    return pa.array(np.require(values, requirements=["C", "A"]))


def _list_array(flat: npt.NDArray[np.generic], lengths: npt.NDArray[np.int64]) -> pa.Array:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), _arrow(flat.reshape(-1)))


def _fixed_list(values: npt.NDArray[np.generic]) -> pa.Array:
    """(n, *shape) -> Array(T) of n rows, each the flattened shape."""
    n = len(values)
    width = int(np.prod(values.shape[1:])) if values.ndim > 1 else 1
    return _list_array(values.reshape(n, width), np.full(n, width, dtype=np.int64))


def _shape_column(n: int, shapes: npt.NDArray[np.int64]) -> pa.Array:
    """Per-row shape arrays: ``shapes`` is (n, ndim)."""
    return _list_array(shapes.astype(np.uint32), np.full(n, shapes.shape[1], dtype=np.int64))


def _tail_shapes(
    output_ids: npt.NDArray[np.generic],
    counts: npt.NDArray[np.int64],
    token_shapes: TokenShapes | None,
) -> pa.Array:
    """Each record's real shape: ``[count / prod(s), *s]`` for its hook's token
    shape ``s`` (``[tokens, hidden]`` for a capture hook), ``[count]`` otherwise."""
    n = len(counts)
    shapes = (
        {}
        if token_shapes is None
        else {int(o): token_shapes(int(o)) for o in np.unique(output_ids)}
    )
    if not any(shapes.values()):
        return _shape_column(n, counts[:, None])
    ndims = np.ones(n, dtype=np.int64)
    for output_id, shape in shapes.items():
        if shape:
            ndims[output_ids == output_id] = 1 + len(shape)
    flat = np.empty(int(ndims.sum()), dtype=np.uint32)
    starts = np.zeros(n, dtype=np.int64)
    np.cumsum(ndims[:-1], out=starts[1:])
    flat[starts] = counts  # flat records; replaced below for shaped hooks
    for output_id, shape in shapes.items():
        if not shape:
            continue
        rows = np.flatnonzero(output_ids == output_id)
        size = max(1, int(np.prod(shape)))
        first = starts[rows]
        flat[first] = counts[rows] // size
        for axis, extent in enumerate(shape, start=1):
            flat[first + axis] = extent
    return _list_array(flat, ndims)


def _scalar_array(values: npt.NDArray[np.generic], column: Column) -> pa.Array:
    if values.dtype.kind == "M":
        return _arrow(values)
    if values.dtype.kind == "S":
        # From the bytes, not tolist(): numpy strips an S value's trailing NULs,
        # which a FixedString(n) value may hold (arrow then refuses the block).
        width = values.dtype.itemsize
        data = pa.py_buffer(np.ascontiguousarray(values).view(np.uint8))
        return pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), len(values), [None, data])
    if values.dtype.kind == "O":
        return pa.array(values.tolist(), type=pa.string())
    return _arrow(values)


def _fixed_columns(
    rows: npt.NDArray[np.void], columns: tuple[Column, ...], out: dict[str, pa.Array]
) -> None:
    """Fixed-size columns of ``rows``; each Array column with its shape beside it."""
    n = len(rows)
    for column in columns:
        values = rows[column.name]
        if column.is_array:
            out[column.name] = _fixed_list(values)
            shape = np.broadcast_to(
                np.asarray(column.shape, dtype=np.int64), (n, len(column.shape))
            )
            out[f"{column.name}_shape"] = _shape_column(n, shape)
        else:
            out[column.name] = _scalar_array(values, column)


def _value_columns(
    records: Records, token_shapes: TokenShapes | None = None
) -> dict[str, pa.Array]:
    layout = records.layout
    out: dict[str, pa.Array] = {}
    if layout.is_fixed:
        _fixed_columns(records.rows(), layout.columns, out)
        return out
    # Fixed prefix columns, then one variable-length tail.
    tail = layout.tail
    assert tail is not None
    desc = records.descriptors
    prefix_columns = layout.fixed_columns
    if prefix_columns:
        prefix_dtype = np.dtype([(c.name, c.dtype) for c in prefix_columns])
        index = desc["offset"][:, None] + np.arange(prefix_dtype.itemsize)
        prefix = records.batch.payload[index].reshape(-1).view(prefix_dtype)
        _fixed_columns(prefix, prefix_columns, out)
    element = tail.element_dtype
    counts = (desc["length"] - layout.prefix_size) // element.itemsize
    out[tail.name] = _list_array(_gather_tails(records.batch, layout.prefix_size, element), counts)
    out[f"{tail.name}_shape"] = _tail_shapes(desc["output_id"], counts, token_shapes)
    return out


def _gather_tails(
    batch: RecordBatch, prefix: int, element: np.dtype[np.generic]
) -> npt.NDArray[np.generic]:
    """Every record's tail bytes, concatenated, as ``element`` values."""
    desc = batch.descriptors
    starts = desc["offset"] + prefix
    sizes = desc["length"] - prefix
    total = int(sizes.sum())
    if total == 0:
        return np.empty(0, dtype=element)
    if prefix == 0 and bool(np.all(starts[1:] == starts[:-1] + sizes[:-1])):
        first = int(starts[0])  # back to back: a view, no copy
        return batch.payload[first : first + total].view(element)
    # Holes between records (a padded capture in a shared pool, a prefix):
    # one native pass of memcpy per record.  An index array of one int64 per
    # byte cost ~180x more and was most of a writer process's Arrow build.
    payload = np.ascontiguousarray(batch.payload).reshape(-1).view(np.uint8)
    packed = gather_ranges(
        payload, starts.astype(np.int64, copy=False), sizes.astype(np.int64, copy=False), total
    )
    return packed.view(element)


class HookDictionary:
    """The ``hook`` column's dictionary (hook names as an Arrow array), built
    once per version of a registry's names.

    ``HookRegistry.names()`` returns a new tuple only when a hook is bound, so
    the tuple's identity is the version: an insert with the same names reuses
    the array instead of converting every name again.  Safe across the sink's
    insert threads: the (names, array) pair is replaced in one assignment.
    """

    def __init__(self) -> None:
        self._cached: tuple[tuple[str, ...], pa.Array] = ((), pa.array([], pa.string()))

    def of(self, names: tuple[str, ...]) -> pa.Array:
        """``names`` as an Arrow string array (the cached one while they are unchanged)."""
        cached = self._cached
        if cached[0] is names:
            return cached[1]
        array = pa.array(names, pa.string())
        self._cached = (names, array)
        return array


def raw_table(
    batch: RecordBatch,
    layout: Layout,
    spec: TableSpec,
    hook_names: Sequence[str] | pa.Array,
    token_shapes: TokenShapes | None = None,
) -> pa.Table:
    """Raw records of ``layout`` as an Arrow table with ``spec``'s columns.

    ``hook_names`` is the ``hook`` column's dictionary (output_id -> name): the
    names, or them already as an Arrow array (:class:`HookDictionary`).
    ``token_shapes`` gives a hook's per-position value shape, so a variable
    tail's ``<column>_shape`` is the record's real shape (``[tokens, hidden]``).
    """
    desc = batch.descriptors
    if not isinstance(hook_names, pa.Array):
        hook_names = pa.array(list(hook_names), pa.string())
    columns: dict[str, pa.Array] = {
        "hook": pa.DictionaryArray.from_arrays(
            pa.array(desc["output_id"].astype(np.int32)), hook_names
        ),
        "output_id": _arrow(desc["output_id"]),
        "key": _arrow(desc["key"]),
        "step": _arrow(desc["step"]),
        "seq": _arrow(desc["seq"]),
        "timestamp": _arrow(desc["timestamp_ns"]).cast(pa.timestamp("ns")),
    }
    columns.update(_value_columns(Records(batch, layout), token_shapes))
    return pa.table({name: columns[name] for name in spec.column_names})


def rows_table(rows: npt.NDArray[np.void], layout: Layout, spec: TableSpec) -> pa.Table:
    """Processed rows of ``layout`` as an Arrow table, column for column."""
    columns: dict[str, pa.Array] = {}
    for column in layout.columns:
        values = rows[column.name]
        if column.is_array and column.shape:
            columns[column.name] = _fixed_list(values)
        elif column.is_array:  # variable arrays held as objects
            arrays = [np.asarray(v, dtype=column.element_dtype).ravel() for v in values]
            lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
            flat = np.concatenate(arrays) if arrays else np.empty(0, column.element_dtype)
            columns[column.name] = _list_array(flat, lengths)
        else:
            columns[column.name] = _scalar_array(values, column)
    return pa.table({name: columns[name] for name in spec.column_names})


def block_table(
    items: Sequence[Batch],
    spec: TableSpec,
    schema: RecordSchema,
    hooks: HookRegistry | None,
    dictionary: HookDictionary,
) -> pa.Table:
    """One insert's Arrow table: ``items`` (all raw records, or all rows, of
    ``spec``'s table) converted and concatenated; raw records are named by
    ``hooks`` (through ``dictionary``, the cached names)."""
    parts: list[pa.Table] = []
    if spec.raw:
        names = hooks.names() if hooks is not None else ()  # a view, no copy
        hook_names = dictionary.of(names)
        shapes = hooks.token_shape_of if hooks is not None else None
        for item in items:
            assert isinstance(item, RecordBatch)
            layout = schema.by_id(int(item.descriptors["layout_id"][0]))
            if len(names) <= int(item.descriptors["output_id"].max()):
                raise ConfigError(
                    "ClickHouseSink has no hook names for these records: give it the "
                    "HookRegistry the producer binds hooks in (hooks=...)"
                )
            parts.append(raw_table(item, layout, spec, hook_names, shapes))
    else:
        for item in items:
            assert isinstance(item, RowBatch)
            parts.append(rows_table(item.rows, schema.layout(item.layout_name), spec))
    return parts[0] if len(parts) == 1 else pa.concat_tables(parts)
