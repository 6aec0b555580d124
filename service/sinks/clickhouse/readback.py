"""Reading back what a ClickHouse sink wrote: raw captures and processor rows.

The inverse of :mod:`taproute.service.sinks.clickhouse.columns`, so it lives
beside it (the flattening rules -- ``values`` with ``values_shape`` beside it
-- are decided there).  Works on any :class:`Transport`: chDB in-process or a
server through clickhouse-connect.

- :func:`load_captures`: raw records by hook (name or glob), key, step range
  and layer, each with its real shape restored (``values_shape`` as written;
  a one-dimensional shape from older tables is reshaped to ``[-1, width]``
  when ``width`` is given, which must agree with any other stored shape),
  as numpy arrays or torch tensors.
- :func:`load_rows`: processor rows of a table as a numpy structured array of
  the output layout's dtype (fixed-shape arrays restored), filtered alike.

Layer = the first integer in the hook name (``encoder.layer.3.output`` -> 3),
the same rule the signal processors use.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import pyarrow as pa

from taproute.routing.errors import ConfigError
from taproute.routing.layout import Layout
from taproute.service.sinks.clickhouse.transport import Transport


class ReadBackError(ConfigError):
    """A read-back request that cannot be answered (no such column, bad shape)."""


@attrs.frozen
class Capture:
    """One raw record read back: its descriptor fields and its values, real shape."""

    hook: str
    key: int
    step: int
    seq: int
    values: Any  # numpy array, or torch tensor with as_torch=True


def _literal(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _glob_regex(pattern: str) -> str:
    """A shell glob (``*``, ``?``, ``[...]``) as an anchored RE2 regex."""
    out, i = ["^"], 0
    while i < len(pattern):
        c = pattern[i]
        if c == "*":
            out.append(".*")
        elif c == "?":
            out.append(".")
        elif c == "[" and "]" in pattern[i + 1 :]:
            end = pattern.index("]", i + 1)
            out.append("[" + pattern[i + 1 : end].replace("!", "^", 1) + "]")
            i = end
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out) + "$"


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_ORDER_TERM = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)(?:\s+(ASC|DESC))?\s*\Z", re.IGNORECASE)


def _name(what: str, value: object) -> str:
    """A table or column name, plain (letters, digits, underscores): it is put
    into the query between backquotes, so anything else could end the name."""
    if isinstance(value, str) and _NAME.match(value):
        return value
    raise ReadBackError(
        f"{what} must be a plain name (letters, digits and underscores), got {value!r}"
    )


def _order(table: str, order_by: str, columns: list[str]) -> str:
    """``order_by`` (``"key, head DESC"``) as an ORDER BY clause over ``columns``;
    anything but column names with an optional ASC/DESC is refused (it is not
    SQL to run: ``"key; DROP TABLE t"`` ran as a second statement)."""
    if not isinstance(order_by, str):
        raise ReadBackError(f"order_by must be a str, got {type(order_by).__name__}")
    terms = []
    for part in order_by.split(","):
        match = _ORDER_TERM.match(part)
        if match is None:
            raise ReadBackError(
                f"{table}: order_by takes column names, each optionally ASC or DESC, "
                f"separated by commas; got {order_by!r}"
            )
        column, direction = match.group(1), (match.group(2) or "ASC").upper()
        if column not in columns:
            raise ReadBackError(
                f"{table}: order_by names {column!r}, not a column read ({', '.join(columns)})"
            )
        terms.append(f"`{column}` {direction}")
    return " ORDER BY " + ", ".join(terms)


def _steps(steps: Any) -> tuple[int, int]:
    first: object
    stop: object
    try:
        first, stop = steps
    except (TypeError, ValueError):
        raise ReadBackError(
            f"steps must be a (first, stop) pair, a half-open range, got {steps!r}"
        ) from None
    return _integer("steps", first), _integer("steps", stop)


def _integer(name: str, value: object) -> int:
    """``value`` as a filter's integer; anything else (``1.5``, ``"3"``, a bool)
    is refused by name, never rounded into another key, step or layer."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        return int(value)
    raise ReadBackError(f"{name} must be integers, got {type(value).__name__} {value!r}")


def _positive(name: str, value: object) -> int:
    """``value`` as a positive integer; anything else is refused by name."""
    if (
        isinstance(value, (int, np.integer))
        and not isinstance(value, (bool, np.bool_))
        and value > 0
    ):
        return int(value)
    raise ReadBackError(f"{name} must be a positive integer, got {type(value).__name__} {value!r}")


def _where(
    *,
    hook: str | None,
    key: int | Iterable[int] | None,
    steps: tuple[int, int] | None,
    layer: int | None,
    extra: dict[str, Any] | None = None,
) -> str:
    """A WHERE clause: ``steps`` is a half-open ``(first, stop)`` range."""
    terms = []
    if hook is not None and not isinstance(hook, str):
        raise ReadBackError(f"hook must be a name or a glob (str), got {type(hook).__name__}")
    if hook is not None:
        if any(c in hook for c in "*?["):
            terms.append(f"match(hook, {_literal(_glob_regex(hook))})")
        else:
            terms.append(f"hook = {_literal(hook)}")
    if key is not None:
        if isinstance(key, Iterable) and not isinstance(key, (str, bytes)):
            keys = [_integer("key", k) for k in key]
        else:
            keys = [_integer("key", key)]
        terms.append(f"key IN ({', '.join(map(str, keys)) or 'NULL'})")
    if steps is not None:
        first, stop = _steps(steps)
        terms.append(f"step >= {first} AND step < {stop}")
    if layer is not None:
        terms.append(f"extract(hook, '[0-9]+') = {_literal(str(_integer('layer', layer)))}")
    for column, value in (extra or {}).items():
        terms.append(f"`{column}` = {_integer(column, value)}")
    return f" WHERE {' AND '.join(terms)}" if terms else ""


def _lists(column: pa.ChunkedArray) -> tuple[npt.NDArray[Any], npt.NDArray[np.int64]]:
    """Flat values and offsets of a list column."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if isinstance(array, pa.ChunkedArray):  # pragma: no cover - empty result
        array = pa.array([], type=column.type)
    flat = array.flatten().to_numpy(zero_copy_only=False)
    offsets = array.offsets.to_numpy().astype(np.int64)
    return flat, offsets


#: numpy's bfloat16 (ml_dtypes', registered by the layouts' import).
_BFLOAT16 = np.dtype("bfloat16")


def _selected(column: str, column_type: str) -> str:
    """``column`` as a SELECT reads it.  ClickHouse hands BFloat16 to Arrow,
    which has no bfloat16, as two-byte binary strings: read it widened to
    Float32 (exact), and narrow it back here (:func:`_bfloat16`)."""
    if "BFloat16" in column_type:
        return f"CAST(`{column}`, {_literal(column_type.replace('BFloat16', 'Float32'))})"
    return f"`{column}`"


def _bfloat16(column_type: str) -> bool:
    return "BFloat16" in column_type


def _check_table(transport: Transport, table: str, needed: list[str], kind: str) -> dict[str, str]:
    """Refuse, by name, a table that does not exist or lacks a column to be
    read; the type of each of its columns, by name."""
    described = transport.describe(table)
    if described is None:
        raise ReadBackError(f"table {table!r} does not exist in {transport.description}")
    has = [name for name, _type in described]
    missing = [name for name in needed if name not in has]
    if missing:
        raise ReadBackError(
            f"{table}: no column{'s' if len(missing) > 1 else ''} "
            f"{', '.join(map(repr, missing))} ({kind}); "
            f"the table has {', '.join(has)}"
        )
    return dict(described)


def load_captures(
    transport: Transport,
    table: str,
    *,
    hook: str | None = None,
    key: int | Iterable[int] | None = None,
    steps: tuple[int, int] | None = None,
    layer: int | None = None,
    column: str = "values",
    width: int | None = None,
    as_torch: bool = False,
) -> list[Capture]:
    """Raw records of ``table`` (e.g. ``raw_activations``) matching the filters,
    ordered by hook, key, step, seq; ``values`` in the shape they were captured in.

    ``width``: the values per position.  A record stored flat (a
    one-dimensional ``values_shape``, older tables) is reshaped to
    ``[-1, width]``; a record stored with its shape keeps it, and a ``width``
    that disagrees with it (its values per position, the product of all but
    its first dimension) is refused, naming the record."""
    table, column = _name("table", table), _name("column", column)
    if width is not None:
        width = _positive("width", width)
    where = _where(hook=hook, key=key, steps=steps, layer=layer)
    needed = ["hook", "key", "step", "seq", column, f"{column}_shape"]
    types = _check_table(transport, table, needed, "a raw capture table has them")
    selected = _selected(column, types[column])
    sql = (
        f"SELECT hook, key, step, seq, {selected} AS v, `{column}_shape` AS s FROM `{table}`"
        f"{where} ORDER BY hook, key, step, seq"
    )
    result = transport.query(sql)
    if result.num_rows == 0:
        return []
    flat, offsets = _lists(result.column("v"))
    if _bfloat16(types[column]):
        flat = flat.astype(_BFLOAT16)  # read as Float32: back to the values stored, exactly
    shape_flat, shape_offsets = _lists(result.column("s"))
    hooks = result.column("hook").to_pylist()
    keys, step_values, seqs = (result.column(c).to_numpy() for c in ("key", "step", "seq"))
    out = []
    for i in range(result.num_rows):
        values = flat[offsets[i] : offsets[i + 1]]
        shape = tuple(int(v) for v in shape_flat[shape_offsets[i] : shape_offsets[i + 1]])
        if len(shape) == 1 and width is not None:
            if shape[0] % width:
                raise ReadBackError(
                    f"{table}: record hook={hooks[i]!r} key={int(keys[i])} has {shape[0]} "
                    f"values, not a multiple of width {width}"
                )
            shape = (shape[0] // width, width)
        elif len(shape) > 1 and width is not None:
            per_position = int(np.prod(shape[1:]))
            if per_position != width:
                raise ReadBackError(
                    f"{table}: width={width} does not match record hook={hooks[i]!r} "
                    f"key={int(keys[i])}, stored with its shape {list(shape)} "
                    f"({column}_shape): {per_position} values per position; width only "
                    f"reshapes records stored flat (a one-dimensional {column}_shape): "
                    f"leave it out, or give {per_position}"
                )
        if int(np.prod(shape)) != len(values):
            raise ReadBackError(
                f"{table}: record hook={hooks[i]!r} key={int(keys[i])}: {column}_shape "
                f"{list(shape)} does not match its {len(values)} values"
            )
        array: Any = values.reshape(shape)
        if as_torch:
            import torch

            owned = np.array(array)  # owned and writable
            if owned.dtype == _BFLOAT16:  # torch takes no numpy bfloat16: its bits
                array = torch.from_numpy(owned.view(np.int16)).view(torch.bfloat16)
            else:
                array = torch.from_numpy(owned)
        out.append(Capture(str(hooks[i]), int(keys[i]), int(step_values[i]), int(seqs[i]), array))
    return out


def load_rows(
    transport: Transport,
    table: str,
    layout: Layout,
    *,
    hook: str | None = None,
    key: int | Iterable[int] | None = None,
    steps: tuple[int, int] | None = None,
    layer: int | None = None,
    order_by: str | None = None,
    **equal: int,
) -> npt.NDArray[np.void]:
    """Rows of ``table`` as a structured array of ``layout``'s dtype.

    Filters apply only to columns the layout has (``key``/``step`` for rows
    that carry them); ``equal`` adds ``column = value`` terms (``window=3``).
    """
    table = _name("table", table)
    names = [c.name for c in layout.columns]
    for column, value in (("hook", hook), ("key", key), ("step", steps)):
        if value is not None and column not in names:
            raise ReadBackError(f"{table}: layout {layout.name!r} has no {column!r} column")
    for column in equal:
        if column not in names:
            raise ReadBackError(f"{table}: layout {layout.name!r} has no {column!r} column")
    where = _where(hook=hook, key=key, steps=steps, layer=layer, extra=equal)
    order = _order(table, order_by, names) if order_by else ""
    types = _check_table(transport, table, names, f"layout {layout.name!r} has it")
    columns = ", ".join(f"{_selected(n, types[n])} AS `{n}`" for n in names)
    result = transport.query(f"SELECT {columns} FROM `{table}`{where}{order}")
    rows = np.zeros(result.num_rows, dtype=layout.dtype)
    if result.num_rows == 0:
        return rows
    for col in layout.columns:
        data = result.column(col.name)
        if col.is_array and col.shape:
            flat, _ = _lists(data)
            rows[col.name] = flat.reshape(result.num_rows, *col.shape)
        elif col.is_array:
            flat, offsets = _lists(data)
            if _bfloat16(types[col.name]):
                flat = flat.astype(_BFLOAT16)
            rows[col.name] = [flat[offsets[i] : offsets[i + 1]] for i in range(result.num_rows)]
        else:
            rows[col.name] = data.to_numpy(zero_copy_only=False)
    return rows
