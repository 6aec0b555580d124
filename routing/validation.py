"""Checks on what producers submit and what processors return.

All checks are vectorised over a batch's descriptors: no per-record Python.
They raise before anything is accepted, naming the first offending record.
"""

from __future__ import annotations

from collections.abc import Callable

import ml_dtypes
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
    numbers that fit the element type in a variable Array column (an int,
    None, bytes or text there would be refused, block and all, by the
    destination, or written as something else: None as '' or [nan], 2**31 in
    an Int32 column as -2**31, 1e300 in a Float32 one as inf)."""
    for column in layout.object_columns:
        values = rows[column.name]
        if column.is_array:
            bad = _first_bad_array(values, column.element_dtype)
            if bad is None:
                continue
            row, expected, found = bad
        elif all(issubclass(kind, str) for kind in set(map(type, values))):
            continue  # one C pass over the column, no Python per value
        else:
            row = next(i for i, value in enumerate(values) if not isinstance(value, str))
            expected, found = "str", _shown(values[row])
        raise OutputLayoutMismatch(
            f"route {route!r}, processor {processor!r}, output layout {layout.name!r}: "
            f"column {column.name!r} ({column.type}) row {row}: expected {expected}, "
            f"found {found}"
        )


def _shown(value: object) -> str:
    try:
        return f"{type(value).__name__} {value!r:.60}"
    except Exception as exc:  # a user object whose repr raises is still named
        return f"{type(value).__name__} (its repr raised {type(exc).__name__})"


def _first_bad_array(
    values: npt.NDArray[np.object_], element: np.dtype[np.generic]
) -> tuple[int, str, str] | None:
    """The first row whose value does not go into an ``Array(element)`` column
    unchanged, as (row, expected, found), or None.

    A value must be an array (or list) of numbers that casts to ``element``
    within its kind (no float into an integer column, which would truncate;
    any integers into an integer column; bfloat16 counts as a float), and,
    where the cast is not safe, whose values fit ``element``: checked per
    dtype over all such rows at once (one concatenation, one comparison or
    cast), never per element.
    """
    unsafe: dict[np.dtype[np.generic], list[tuple[int, npt.NDArray[np.generic]]]] = {}
    for row, value in enumerate(values):  # one object per row: the column's own shape
        if isinstance(value, np.ndarray):
            array = value
        elif isinstance(value, list | tuple):
            try:
                array = np.asarray(value)
            except Exception:  # ragged, or an element numpy cannot take (a tensor needing grad)
                return row, _KIND_EXPECTED.format(element), _shown(value)
        else:
            return row, _KIND_EXPECTED.format(element), _shown(value)
        if array.ndim < 1 or not _same_kind(array.dtype, element):
            return row, _KIND_EXPECTED.format(element), _shown(value)
        if not np.can_cast(array.dtype, element, "safe"):
            unsafe.setdefault(array.dtype, []).append((row, array))
    first: tuple[int, str, str] | None = None
    for dtype, group in unsafe.items():
        bad = _first_unfit(dtype, group, element)
        if bad is not None and (first is None or bad[0] < first[0]):
            first = bad
    return first


_KIND_EXPECTED = "an array of numbers that cast to {} (same kind)"


def _same_kind(found: np.dtype[np.generic], element: np.dtype[np.generic]) -> bool:
    """Numbers of ``found`` may go into ``element`` if their values fit: any
    integers (and bools) into an integer column, integers and floats into a
    float one (text, objects, dates, records never)."""
    if element.kind in "iu":
        return found.kind in "biu"
    return bool(np.can_cast(found, element, "same_kind"))


def _first_unfit(
    dtype: np.dtype[np.generic],
    group: list[tuple[int, npt.NDArray[np.generic]]],
    element: np.dtype[np.generic],
) -> tuple[int, str, str] | None:
    """The first row of ``group`` (arrays of ``dtype``) holding a value that
    ``element`` cannot hold: outside an integer type's bounds, or a finite
    value that the cast to a float type turns into infinity."""
    flat = np.concatenate([array.ravel() for _, array in group])
    if element.kind in "iu":
        info = np.iinfo(element)  # type: ignore[type-var]
        unfit = (flat < int(info.min)) | (flat > int(info.max))
        expected = f"values that fit {element} [{int(info.min)}, {int(info.max)}]"
    else:
        with np.errstate(over="ignore", invalid="ignore"):
            unfit = np.isinf(flat.astype(element)) & np.isfinite(flat)
        top = ml_dtypes.finfo(element).max  # type: ignore[no-untyped-call]
        expected = f"values that fit {element} (finite values up to {top:.8g} in magnitude)"
    if not unfit.any():
        return None
    position = int(np.argmax(unfit))
    ends = np.cumsum([array.size for _, array in group])
    index = int(np.searchsorted(ends, position, side="right"))
    row = group[index][0]
    value = flat[position]
    return row, expected, f"{value!s:.40} ({dtype}), which {element} would not keep"
