"""Checks on what producers submit and what processors return.

All checks are vectorised over a batch's descriptors: no per-record Python.
They raise before anything is accepted, naming the first offending record.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt
from taproute.routing.batch import RecordBatch
from taproute.routing.errors import OutputLayoutMismatch, PayloadSizeMismatch, UnboundOutputId
from taproute.routing.layout import Layout
from taproute.routing.schema import RecordSchema


def check_batch(
    batch: RecordBatch,
    *,
    bound_ids: int,
    schema: RecordSchema | None,
    hook_name: Callable[[int], str],
) -> None:
    """Raise if any record of ``batch`` cannot be routed.

    - every output_id was bound (``< bound_ids``);
    - every payload range lies inside the buffer;
    - with a schema: every layout_id exists, and every payload length fits
      its layout (equal to the row size for fixed layouts; the fixed prefix
      plus a whole number of elements for a variable tail).
    """
    desc = batch.descriptors
    if len(desc) == 0:
        return
    ids = desc["output_id"]
    bad = np.flatnonzero(ids >= bound_ids)
    if bad.size:
        i = int(bad[0])
        raise UnboundOutputId(
            f"record {i} of the batch: output_id {int(ids[i])} was never bound with bind_hook "
            f"({bound_ids} hooks bound); {bad.size} record(s) affected, batch refused"
        )
    offsets, lengths = desc["offset"], desc["length"]
    size = len(batch.payload)
    bad = np.flatnonzero((offsets < 0) | (lengths < 0) | (offsets + lengths > size))
    if bad.size:
        i = int(bad[0])
        raise PayloadSizeMismatch(
            f"record {i} (hook {hook_name(int(ids[i]))!r}): payload range "
            f"[{int(offsets[i])}, {int(offsets[i] + lengths[i])}) outside the {size}-byte buffer"
        )
    if schema is None:
        return
    layout_ids = desc["layout_id"]
    for layout_id in np.unique(layout_ids):
        lid = int(layout_id)
        mask = layout_ids == layout_id
        if lid >= len(schema.layouts):
            i = int(np.flatnonzero(mask)[0])
            raise PayloadSizeMismatch(
                f"record {i} (hook {hook_name(int(ids[i]))!r}): layout_id {lid} is not in the "
                f"schema (ids 0..{len(schema.layouts) - 1})"
            )
        layout = schema.by_id(lid)
        _check_lengths(layout, lengths, mask, ids, hook_name)


def _check_lengths(
    layout: Layout,
    lengths: npt.NDArray[np.int64],
    mask: npt.NDArray[np.bool_],
    ids: npt.NDArray[np.uint32],
    hook_name: Callable[[int], str],
) -> None:
    tail = layout.tail
    if tail is None:
        expected = layout.dtype.itemsize
        bad = np.flatnonzero(mask & (lengths != expected))
        rule = f"{expected} bytes"
    else:
        prefix, elem = layout.prefix_size, tail.element_dtype.itemsize
        bad = np.flatnonzero(mask & ((lengths < prefix) | ((lengths - prefix) % elem != 0)))
        rule = f"{prefix} bytes + a multiple of {elem}"
    if bad.size:
        i = int(bad[0])
        raise PayloadSizeMismatch(
            f"record {i} (hook {hook_name(int(ids[i]))!r}): payload of {int(lengths[i])} bytes "
            f"does not fit layout {layout.name!r} ({rule}); {bad.size} record(s) affected, "
            "batch refused"
        )


def check_rows(rows: object, layout: Layout, *, route: str, processor: str) -> npt.NDArray[np.void]:
    """Return ``rows`` if it is a structured array of ``layout``'s columns, else raise.

    The error names route, processor, the column, and the expected and found
    types.
    """
    where = f"route {route!r}, processor {processor!r}, output layout {layout.name!r}"
    if not isinstance(rows, np.ndarray) or rows.dtype.names is None:
        found = type(rows).__name__
        if isinstance(rows, np.ndarray):
            found = f"array of {rows.dtype}"
        raise OutputLayoutMismatch(f"{where}: expected a structured numpy array, found {found}")
    if rows.ndim != 1:
        raise OutputLayoutMismatch(
            f"{where}: expected a 1-D array of rows, found shape {rows.shape}"
        )
    expected_names = [c.name for c in layout.columns]
    found_names = list(rows.dtype.names)
    for position, column in enumerate(layout.columns):
        if position >= len(found_names):
            raise OutputLayoutMismatch(
                f"{where}: column {column.name!r} ({column.type}) missing; found columns "
                f"{found_names}"
            )
        name = found_names[position]
        if name != column.name:
            raise OutputLayoutMismatch(
                f"{where}: column {position} expected {column.name!r}, found {name!r}"
            )
        found_dtype = rows.dtype.fields[name][0]
        if found_dtype != column.dtype:
            raise OutputLayoutMismatch(
                f"{where}: column {column.name!r} expected {column.type} ({column.dtype}), "
                f"found {found_dtype}"
            )
    if len(found_names) > len(expected_names):
        raise OutputLayoutMismatch(
            f"{where}: unexpected column(s) {found_names[len(expected_names) :]}"
        )
    return rows
