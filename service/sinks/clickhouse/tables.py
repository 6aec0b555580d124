"""How layouts become ClickHouse tables, and the check that a table fits.

Raw records (forwarded or unmatched) land in one table per payload layout:
the descriptor columns, then the layout's columns, each ``Array`` column
flattened with its shape beside it (``values``, ``values_shape``).  Processed
rows land in one table per output layout, column for column.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import attrs
import numpy as np

from taproute.routing.batch import Batch, RowBatch
from taproute.routing.errors import ConfigError
from taproute.routing.layout import Layout
from taproute.routing.schema import RecordSchema


class SchemaMismatch(ConfigError):
    """A destination table's columns disagree with the layout it receives."""


class MissingTable(ConfigError):
    """A destination table does not exist and ``create_tables`` is off."""


@attrs.frozen
class TableColumn:
    """A column as ClickHouse declares it."""

    name: str
    type: str


#: The descriptor part of every raw table, in order.
DESCRIPTOR_COLUMNS: tuple[TableColumn, ...] = (
    TableColumn("hook", "LowCardinality(String)"),
    TableColumn("output_id", "UInt32"),
    TableColumn("key", "Int64"),
    TableColumn("step", "Int64"),
    TableColumn("seq", "Int64"),
    TableColumn("timestamp", "DateTime64(9)"),
)


@attrs.frozen
class TableSpec:
    """A table a ClickHouse sink writes: its name, columns and sort key."""

    name: str
    columns: tuple[TableColumn, ...]
    order_by: str
    raw: bool

    def create_sql(self, settings: Mapping[str, int] | None = None) -> str:
        """``CREATE TABLE IF NOT EXISTS``: MergeTree, with a deduplication window
        so that a retried insert (same token) is not written twice, and
        ``settings`` (MergeTree settings, a transport's ``table_settings``)."""
        cols = ",\n  ".join(f"`{c.name}` {c.type}" for c in self.columns)
        extra = "".join(f", {name} = {int(value)}" for name, value in (settings or {}).items())
        return (
            f"CREATE TABLE IF NOT EXISTS `{self.name}` (\n  {cols}\n) ENGINE = MergeTree "
            f"ORDER BY {self.order_by} SETTINGS non_replicated_deduplication_window = 10000"
            f"{extra}"
        )

    @property
    def column_names(self) -> list[str]:
        """Column names in insert order."""
        return [c.name for c in self.columns]


def raw_table_spec(layout: Layout, name: str) -> TableSpec:
    """The table raw records of ``layout`` go to."""
    columns = list(DESCRIPTOR_COLUMNS)
    for column in layout.columns:
        if column.is_array:
            columns.append(TableColumn(column.name, column.type))
            columns.append(TableColumn(f"{column.name}_shape", "Array(UInt32)"))
        else:
            columns.append(TableColumn(column.name, column.type))
    return TableSpec(name, tuple(columns), "(hook, key, step, seq)", raw=True)


def rows_table_spec(layout: Layout, name: str) -> TableSpec:
    """The table processed rows of ``layout`` go to (multi-dimensional arrays flattened)."""
    columns = tuple(TableColumn(c.name, c.type) for c in layout.columns)
    return TableSpec(name, columns, "tuple()", raw=False)


_SPACES = re.compile(r"\s+")


def normalize_type(ch_type: str) -> str:
    """A type as ClickHouse prints it, for comparison (``DateTime64(9, 'UTC')`` stays distinct)."""
    return _SPACES.sub("", ch_type).replace("'", "")


def check_table(spec: TableSpec, found: list[tuple[str, str]]) -> None:
    """Raise :class:`SchemaMismatch` unless every column of ``spec`` exists with its type.

    Extra columns in the table are fine (they take their defaults).
    """
    found_types = {name: ch_type for name, ch_type in found}
    for column in spec.columns:
        actual = found_types.get(column.name)
        if actual is None:
            raise SchemaMismatch(
                f"table {spec.name!r}: column {column.name!r} expected {column.type}, "
                f"found no such column (table has {sorted(found_types)})"
            )
        if normalize_type(actual) != normalize_type(column.type):
            raise SchemaMismatch(
                f"table {spec.name!r}: column {column.name!r} expected {column.type}, "
                f"found {actual}"
            )


def split_by_table(
    batch: Batch, raw: dict[int, TableSpec], rows: dict[str, TableSpec], schema: RecordSchema
) -> list[tuple[str, Batch]]:
    """``batch`` split by destination table (raw records by layout id in ``raw``,
    rows by layout name in ``rows``), all checked before any is taken: a
    layout the sink does not write is refused."""
    if isinstance(batch, RowBatch):
        spec = rows.get(batch.layout_name)
        if spec is None:
            raise ConfigError(
                f"ClickHouseSink got rows of layout {batch.layout_name!r} from route "
                f"{batch.route!r}; it writes rows of {sorted(rows)}"
            )
        return [(spec.name, batch)]
    if len(batch) == 0:
        return []
    layout_ids = batch.descriptors["layout_id"]
    first = int(layout_ids[0])
    if bool(np.all(layout_ids == first)):
        split: list[tuple[int, Batch]] = [(first, batch)]
    else:
        split = [
            (int(lid), batch.select(np.flatnonzero(layout_ids == lid)))
            for lid in np.unique(layout_ids)
        ]
    parts = []
    for layout_id, part in split:
        spec = raw.get(layout_id)
        if spec is None:
            raise ConfigError(
                f"ClickHouseSink got raw records of layout "
                f"{schema.by_id(layout_id).name!r}; it writes raw "
                f"{sorted(schema.by_id(i).name for i in raw)}"
            )
        parts.append((spec.name, part))
    return parts
