"""Layouts: ordered, typed columns shared by payloads, processor outputs and
ClickHouse tables.

Each column has a ClickHouse type and the numpy dtype it maps to.  A layout is
*fixed* when every column has a fixed byte size (its rows form one numpy
structured array over the payload bytes); an input layout may instead end in
one variable-length ``Array(T)`` column whose length the record's payload size
decides.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Sequence

import attrs
import ml_dtypes  # noqa: F401 - registers numpy's "bfloat16" dtype (BFloat16 columns)
import numpy as np

from taproute.routing.errors import LayoutError

_SCALARS: dict[str, str] = {
    "Int8": "<i1",
    "Int16": "<i2",
    "Int32": "<i4",
    "Int64": "<i8",
    "UInt8": "<u1",
    "UInt16": "<u2",
    "UInt32": "<u4",
    "UInt64": "<u8",
    "Float32": "<f4",
    "Float64": "<f8",
    # numpy has no bfloat16 of its own: ml_dtypes' is a real numeric dtype
    # (casts, arithmetic), so processors compute on BFloat16 values directly.
    "BFloat16": "bfloat16",
    "Bool": "?",
    "DateTime": "<M8[s]",
}
_DATETIME64_UNITS = {0: "s", 3: "ms", 6: "us", 9: "ns"}
_WRAPPER = re.compile(r"^(\w+)\((.*)\)$")


def _element_dtype(ch_type: str, *, where: str) -> np.dtype[np.generic]:
    """The numpy dtype of one ClickHouse value (no arrays)."""
    if ch_type in _SCALARS:
        return np.dtype(_SCALARS[ch_type])
    if ch_type == "String":
        return np.dtype(object)
    m = _WRAPPER.match(ch_type)
    if m:
        outer, inner = m.group(1), m.group(2).strip()
        if outer == "LowCardinality":
            return _element_dtype(inner, where=where)
        if outer == "FixedString" and inner.isdigit():
            return np.dtype(f"S{int(inner)}")
        if outer == "DateTime64":
            precision = int(inner.split(",")[0]) if inner.split(",")[0].strip().isdigit() else -1
            if precision in _DATETIME64_UNITS:
                return np.dtype(f"<M8[{_DATETIME64_UNITS[precision]}]")
    raise LayoutError(
        f"{where}: ClickHouse type {ch_type!r} does not map to a numpy dtype "
        f"(supported: {', '.join(_SCALARS)}, String, LowCardinality(T), FixedString(n), "
        "DateTime64(0|3|6|9), Array(T))"
    )


def _array_element(ch_type: str) -> str | None:
    m = _WRAPPER.match(ch_type)
    if m and m.group(1) == "Array":
        return m.group(2).strip()
    return None


#: The largest dimension of a column's shape (a config file's bound too).
MAX_DIMENSION = 2**31


def _to_shape(value: Iterable[int]) -> tuple[int, ...]:
    """``value`` as a tuple, numpy's integers as ints (checked by :class:`Column`)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise LayoutError(f"shape must be a sequence of dimensions, got {value!r}")
    return tuple(int(v) if isinstance(v, np.integer) else v for v in value)


@attrs.frozen
class Column:
    """One named, typed column.

    ``type`` is a ClickHouse type.  For ``Array(T)`` columns, ``shape`` fixes
    the element shape (so the column has a fixed size); an ``Array(T)`` with
    no shape is variable-length.
    """

    name: str = attrs.field()
    type: str = attrs.field()
    shape: tuple[int, ...] = attrs.field(default=(), converter=_to_shape)

    @name.validator
    def _check_name(self, _: object, value: str) -> None:
        if not isinstance(value, str) or not value.isidentifier():
            raise LayoutError(f"column name must be an identifier, got {value!r}")

    def __attrs_post_init__(self) -> None:
        shape = self.shape
        where = f"column {self.name!r}"
        if not all(
            isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_DIMENSION
            for v in shape
        ):
            raise LayoutError(
                f"{where}: shape must be integer dimensions in [1, 2**31], got {shape!r}"
            )
        if shape and _array_element(self.type) is None:
            raise LayoutError(
                f"{where}: shape {shape!r} on type {self.type}, which holds one value; "
                f"a shape is for Array(T) columns (Array({self.type}))"
            )

    @functools.cached_property
    def is_array(self) -> bool:
        """True for ``Array(T)`` columns."""
        return _array_element(self.type) is not None

    @functools.cached_property
    def element_dtype(self) -> np.dtype[np.generic]:
        """The numpy dtype of one value (of one array element for arrays)."""
        inner = _array_element(self.type)
        return _element_dtype(
            inner if inner is not None else self.type, where=f"column {self.name!r}"
        )

    @functools.cached_property
    def is_variable(self) -> bool:
        """True when the column's byte size is not fixed (String, or Array without shape)."""
        return self.element_dtype.kind == "O" or (self.is_array and not self.shape)

    @functools.cached_property
    def dtype(self) -> np.dtype[np.generic]:
        """The numpy dtype of the column in a row (object for variable columns)."""
        if self.is_variable:
            return np.dtype(object)
        if self.is_array:
            return np.dtype((self.element_dtype, self.shape))
        return self.element_dtype


ColumnSpec = Column | tuple[str, str] | tuple[str, str, Sequence[int]]


def _to_column(spec: ColumnSpec) -> Column:
    if isinstance(spec, Column):
        return spec
    return Column(*spec)


def _to_columns(specs: Iterable[ColumnSpec]) -> tuple[Column, ...]:
    return tuple(_to_column(s) for s in specs)


@attrs.frozen(init=False)
class Layout:
    """A named, ordered list of columns and the numpy dtype of one row.

    >>> Layout("qk_stats", [("head", "UInt16"), ("norm", "Float32")]).dtype
    dtype([('head', '<u2'), ('norm', '<f4')])
    """

    name: str
    columns: tuple[Column, ...]

    def __init__(self, name: str, columns: Iterable[ColumnSpec]) -> None:
        try:
            built = _to_columns(columns)
        except LayoutError as exc:  # a column refused: say in which layout
            raise LayoutError(f"layout {name!r}, {exc}") from None
        self.__attrs_init__(name, built)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise LayoutError(f"layout name: expected a non-empty str, found {self.name!r}")
        if not self.columns:
            raise LayoutError(f"layout {self.name!r} has no columns")
        seen: set[str] = set()
        for col in self.columns:
            if col.name in seen:
                raise LayoutError(f"layout {self.name!r}: duplicate column {col.name!r}")
            seen.add(col.name)
            try:
                col.element_dtype  # noqa: B018 - validates the type eagerly
            except LayoutError as exc:
                raise LayoutError(f"layout {self.name!r}, {exc}") from None

    @functools.cached_property
    def dtype(self) -> np.dtype[np.void]:
        """Structured dtype of one row (packed, in column order)."""
        return np.dtype([(c.name, c.dtype) for c in self.columns])

    @functools.cached_property
    def element_dtype(self) -> np.dtype[np.generic] | None:
        """The one numpy type of every value in a row (each column's
        :attr:`Column.element_dtype`) when all columns share it, else None:
        what a plain numeric array carrying this layout's payload must be."""
        types = {column.element_dtype for column in self.columns}
        return types.pop() if len(types) == 1 else None

    @functools.cached_property
    def string_columns(self) -> tuple[Column, ...]:
        """The String (and LowCardinality(String)) columns: object dtype in a
        row, so a value of another type is seen only by looking at it."""
        return tuple(c for c in self.columns if not c.is_array and c.element_dtype.kind == "O")

    @functools.cached_property
    def object_columns(self) -> tuple[Column, ...]:
        """The columns a row holds as Python objects: String ones and
        variable-length Array ones (whose values are arrays of any length)."""
        return tuple(c for c in self.columns if c.is_variable)

    @functools.cached_property
    def is_fixed(self) -> bool:
        """True when every column has a fixed byte size."""
        return not any(c.is_variable for c in self.columns)

    @functools.cached_property
    def fixed_columns(self) -> tuple[Column, ...]:
        """The columns before a variable tail (all of them for fixed layouts)."""
        return self.columns if self.is_fixed else self.columns[:-1]

    @functools.cached_property
    def prefix_size(self) -> int:
        """Bytes taken by the fixed columns of a payload."""
        return int(np.dtype([(c.name, c.dtype) for c in self.fixed_columns]).itemsize)

    @functools.cached_property
    def tail(self) -> Column | None:
        """The variable-length trailing ``Array(T)`` column of a payload layout, if any."""
        return None if self.is_fixed else self.columns[-1]

    def check_payload_layout(self) -> None:
        """Raise :class:`LayoutError` unless records can carry this layout as raw bytes.

        Payload layouts are fixed, or fixed columns followed by one
        variable-length ``Array(T)`` of a fixed-size element type.
        """
        for col in self.columns[:-1]:
            if col.is_variable:
                raise LayoutError(
                    f"layout {self.name!r}, column {col.name!r}: a variable-length column "
                    "can only be the last column of a payload layout"
                )
        last = self.columns[-1]
        if last.is_variable and (not last.is_array or last.element_dtype.kind == "O"):
            raise LayoutError(
                f"layout {self.name!r}, column {last.name!r}: type {last.type} has no fixed "
                "byte encoding; payload layouts use numeric, FixedString or Array(numeric) columns"
            )
