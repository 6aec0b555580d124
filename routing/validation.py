"""Checks on what producers submit and what processors return.

All checks are vectorised over a batch's descriptors: no per-record Python.
They raise before anything is accepted, naming the first offending record.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from taproute.native import (
    NOT_A_PAYLOAD_LAYOUT,
    OK,
    RANGE_OUTSIDE_BUFFER,
    UNBOUND_OUTPUT_ID,
    UNKNOWN_LAYOUT,
    check_descriptors,
)
from taproute.routing.batch import Descriptors
from taproute.routing.errors import OutputLayoutMismatch, PayloadSizeMismatch, UnboundOutputId
from taproute.routing.layout import Layout
from taproute.routing.schema import RecordSchema

_EMPTY_RULES = (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))


def check_batch(
    desc: Descriptors,
    payload_size: int,
    *,
    bound_ids: int,
    schema: RecordSchema | None,
    hook_name: Callable[[int], str],
) -> int:
    """Raise if any record of a batch cannot be routed; else return its payload bytes.

    - every output_id was bound (``< bound_ids``);
    - every payload range lies inside the buffer;
    - with a schema: every layout_id exists and is a payload layout, and every
      payload length fits it (the row size for fixed layouts; the fixed prefix
      plus a whole number of elements for a variable tail).

    One native pass; the message names the first offending record.
    """
    rules = _EMPTY_RULES if schema is None else schema.payload_rules
    code, i, total = check_descriptors(desc, payload_size, bound_ids, *rules)
    if code == OK:
        return total
    oid = int(desc["output_id"][i])
    if code == UNBOUND_OUTPUT_ID:
        raise UnboundOutputId(
            f"record {i} of the batch: output_id {oid} was never bound with bind_hook "
            f"({bound_ids} hooks bound); batch refused"
        )
    where = f"record {i} (hook {hook_name(oid)!r})"
    offset, length = int(desc["offset"][i]), int(desc["length"][i])
    if code == RANGE_OUTSIDE_BUFFER:
        raise PayloadSizeMismatch(
            f"{where}: payload range [{offset}, {offset + length}) outside the "
            f"{payload_size}-byte buffer; batch refused"
        )
    assert schema is not None
    layout_id = int(desc["layout_id"][i])
    if code == UNKNOWN_LAYOUT:
        raise PayloadSizeMismatch(
            f"{where}: layout_id {layout_id} is not in the schema "
            f"(ids 0..{len(schema.layouts) - 1}); batch refused"
        )
    layout = schema.by_id(layout_id)
    if code == NOT_A_PAYLOAD_LAYOUT:
        raise PayloadSizeMismatch(
            f"{where}: layout {layout.name!r} has no byte encoding and cannot be a payload; "
            "batch refused"
        )
    tail = layout.tail
    if tail is None:
        rule = f"{layout.dtype.itemsize} bytes"
    else:
        rule = f"{layout.prefix_size} bytes + a multiple of {tail.element_dtype.itemsize}"
    raise PayloadSizeMismatch(
        f"{where}: payload of {length} bytes does not fit layout {layout.name!r} ({rule}); "
        "batch refused"
    )


def check_rows(rows: object, layout: Layout, *, route: str, processor: str) -> npt.NDArray[np.void]:
    """Return ``rows`` if it is a structured array of ``layout``'s columns, else raise.

    The error names route, processor, the column, and the expected and found
    types.
    """
    if isinstance(rows, np.ndarray) and rows.ndim == 1 and rows.dtype == layout.dtype:
        # The layout's own dtype (the usual case): one comparison, no walk, but
        # of String columns (object dtype whatever they hold) each value's type.
        if layout.object_columns:
            _check_objects(rows, layout, route=route, processor=processor)
        return rows
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
    if layout.object_columns:
        _check_objects(rows, layout, route=route, processor=processor)
    return rows


def _check_objects(
    rows: npt.NDArray[np.void], layout: Layout, *, route: str, processor: str
) -> None:
    """Raise unless every value of ``layout``'s object columns is what its
    type holds: a ``str`` in a String column, a non-empty-dimensioned array of
    numbers in a variable Array column (an int, None, bytes or text there
    would be refused, block and all, by the destination, or written as
    something else: None as '' or [nan])."""
    for column in layout.object_columns:
        values = rows[column.name]
        if column.is_array:
            row = _first_non_numeric_array(values, column.element_dtype)
            expected = f"an array of numbers that cast to {column.element_dtype} (same kind)"
        elif all(issubclass(kind, str) for kind in set(map(type, values))):
            continue  # one C pass over the column, no Python per value
        else:
            row = next(i for i, value in enumerate(values) if not isinstance(value, str))
            expected = "str"
        if row is None:
            continue
        value = values[row]
        raise OutputLayoutMismatch(
            f"route {route!r}, processor {processor!r}, output layout {layout.name!r}: "
            f"column {column.name!r} ({column.type}) row {row}: expected {expected}, found "
            f"{type(value).__name__} {value!r:.60}"
        )


def _first_non_numeric_array(
    values: npt.NDArray[np.object_], element: np.dtype[np.generic]
) -> int | None:
    """The first row whose value is not an array (or list) of numbers that
    casts to ``element`` within its kind (no float into an integer column,
    which would truncate), or None."""
    for row, value in enumerate(values):
        if isinstance(value, np.ndarray):
            array = value
        elif isinstance(value, list | tuple):
            try:
                array = np.asarray(value)
            except ValueError:  # ragged
                return row
        else:
            return row
        # Numbers only (text, objects, dates, records never cast within kind);
        # bfloat16 counts as a float.
        if array.ndim < 1 or not np.can_cast(array.dtype, element, "same_kind"):
            return row
    return None
