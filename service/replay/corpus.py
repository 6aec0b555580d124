"""Corpus sources: the raw tables taproute's ClickHouse destinations write
(chDB or a server), and Parquet/Arrow files exported from them.

A corpus checks itself against the schema, enumerates its work units for a
set of filters (deterministically), and reads one unit as an Arrow table with
the raw table's columns, in a fixed order (hook, key, step, seq, timestamp).
"""

from __future__ import annotations

import glob
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from taproute.routing.schema import RecordSchema
from taproute.service.replay.decode import DESCRIPTOR_NAMES
from taproute.service.replay.errors import LayoutMismatch, MissingSource, plain_table
from taproute.service.replay.units import Filters, WorkUnit, pack_keys, unit_id
from taproute.service.sinks.clickhouse.tables import (
    SchemaMismatch,
    TableSpec,
    check_table,
    raw_table_spec,
)
from taproute.service.sinks.clickhouse.transport import Transport


class Corpus(Protocol):
    """What a replay needs from a source of stored records."""

    layout: str
    filters: Filters

    def identity(self) -> dict[str, Any]:
        """What the corpus is, JSON-able (for the ledger and the config hash)."""
        ...

    def check(self, schema: RecordSchema) -> None:
        """Raise unless the source exists and holds ``layout``'s raw columns."""
        ...

    def hooks(self) -> list[str]:
        """The hook names the filters select, sorted (the replay binds them in this order)."""
        ...

    def plan(self, unit_rows: int) -> list[WorkUnit]:
        """The work units, in a deterministic order."""
        ...

    def read(self, unit: WorkUnit) -> pa.Table:
        """One unit's records (raw table columns), in (hook, key, step, seq) order."""
        ...


def _quote(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


class ClickHouseCorpus:
    """A raw table (``raw_<layout>`` by default) on chDB or a server."""

    def __init__(
        self,
        transport: Transport,
        layout: str,
        *,
        table: str | None = None,
        filters: Filters | None = None,
    ) -> None:
        self.transport = transport
        self.layout = layout
        self.table = plain_table("corpus", table or f"raw_{layout}")
        self.filters = filters or Filters()
        self._spec: TableSpec | None = None
        self._hooks: list[str] | None = None

    @classmethod
    def chdb(cls, path: str | Path, layout: str, **kwargs: Any) -> ClickHouseCorpus:
        """A raw table in the chDB directory ``path`` (this process's chDB session)."""
        from taproute.service.sinks.clickhouse.transport import ChdbTransport

        return cls(ChdbTransport(path), layout, **kwargs)

    @classmethod
    def server(cls, url: str, layout: str, **kwargs: Any) -> ClickHouseCorpus:
        """A raw table on a ClickHouse server (``http://user:pass@host:8123/db``)."""
        from taproute.service.sinks.clickhouse.transport import ServerTransport

        return cls(ServerTransport(url), layout, **kwargs)

    def identity(self) -> dict[str, Any]:
        return {
            "kind": "clickhouse",
            "where": self.transport.description,
            "table": self.table,
            "layout": self.layout,
            "filters": self.filters.as_dict(),
        }

    def check(self, schema: RecordSchema) -> None:
        layout = schema.layout(self.layout)
        spec = raw_table_spec(layout, self.table)
        found = self.transport.describe(self.table)
        if found is None:
            raise MissingSource(
                f"corpus table {self.table!r} does not exist in {self.transport.description}"
            )
        try:
            check_table(spec, found)
        except SchemaMismatch as exc:
            raise LayoutMismatch(
                f"corpus table {self.table!r} does not hold raw records of layout "
                f"{self.layout!r}: {exc}"
            ) from None
        self._spec = spec

    def _where(self, hooks: Sequence[str]) -> str:
        listed = ", ".join(_quote(h) for h in hooks) or "''"
        return f"hook IN ({listed}) AND {self.filters.sql()}"

    def hooks(self) -> list[str]:
        if self._hooks is None:
            found = self.transport.query(f"SELECT DISTINCT toString(hook) AS h FROM `{self.table}`")
            names = found.column("h").to_pylist() if found.num_columns else []
            self._hooks = self.filters.select_hooks(names)
        return self._hooks

    def plan(self, unit_rows: int) -> list[WorkUnit]:
        """Per hook, consecutive keys packed into units of about ``unit_rows``
        records (one key is never split, so a unit holds whole sequences)."""
        hooks = self.hooks()
        if not hooks:
            return []
        # The table is sorted by (hook, key, ...): aggregating in that order
        # streams instead of hashing every row (half the CPU of this query).
        counts = self.transport.query(
            f"SELECT toString(hook) AS h, key, count() AS n FROM `{self.table}` "
            f"WHERE {self._where(hooks)} GROUP BY h, key ORDER BY h, key "
            "SETTINGS optimize_aggregation_in_order = 1"
        )
        if not counts.num_rows:
            return []
        packed = pack_keys(
            np.asarray(counts.column("h").to_numpy(zero_copy_only=False), dtype=object),
            np.asarray(counts.column("key").to_numpy(), dtype=np.int64),
            np.asarray(counts.column("n").to_numpy(), dtype=np.int64),
            unit_rows,
        )
        return [
            WorkUnit(
                id=unit_id(self.table, self.layout, hook, first_key, last_key),
                source=self.table,
                rows=rows,
                hook=hook,
                key_first=first_key,
                key_last=last_key,
            )
            for hook, first_key, last_key, rows in packed
        ]

    def columns(self) -> list[str]:
        """The raw table's columns a unit read returns (not the ``*_shape``
        columns: the layout fixes shapes, and list lengths give tails)."""
        assert self._spec is not None, "check() first"
        return [c for c in self._spec.column_names if not c.endswith("_shape")]

    def read(self, unit: WorkUnit) -> pa.Table:
        """The unit's rows, :meth:`columns` in order, sorted by (key, step,
        seq, timestamp).  A unit holds one hook, so ``hook`` is not read: it
        is the unit's, repeated (reading it made the server turn the column
        into one string per row).  The server sorts by the table's own key
        (``hook, key, step, seq``: it reads in that order, no sort), and rows
        equal in all of it are put in timestamp order here
        (:func:`timestamp_within_ties`)."""
        assert unit.hook is not None
        columns = self.columns()
        names = ", ".join(f"`{c}`" for c in columns if c != "hook")
        table = self.transport.query(
            f"SELECT {names} FROM `{self.table}` WHERE hook = {_quote(unit.hook)} "
            f"AND key >= {unit.key_first} AND key <= {unit.key_last} AND {self.filters.sql()} "
            "ORDER BY key, step, seq"
        )
        if not table.num_columns:  # no rows came back at all
            return table
        table = timestamp_within_ties(table)
        return table.add_column(columns.index("hook"), "hook", pa.repeat(unit.hook, table.num_rows))


def _int64(column: pa.ChunkedArray) -> npt.NDArray[np.int64]:
    return np.asarray(column.combine_chunks().to_numpy(zero_copy_only=False), dtype=np.int64)


def timestamp_within_ties(table: pa.Table) -> pa.Table:
    """``table``, sorted by (key, step, seq), with rows equal in all three put
    in timestamp order: sorted by (key, step, seq, timestamp), as one
    ``ORDER BY`` would, but the server sorted every unit again for the
    fourth column (a FinishSorting step: about a fifth of a unit read's
    CPU), and ties are rare: found in a few vector compares, and only then
    sorted here."""
    if table.num_rows < 2:
        return table
    key, step, seq = (_int64(table.column(c)) for c in ("key", "step", "seq"))
    tied = (key[1:] == key[:-1]) & (step[1:] == step[:-1]) & (seq[1:] == seq[:-1])
    if not tied.any():
        return table
    timestamp = table.column("timestamp").cast(pa.timestamp("ns")).cast(pa.int64())
    order = np.lexsort((_int64(timestamp), seq, step, key))  # the last key sorts first
    return table.take(pa.array(order))


class ParquetCorpus:
    """Parquet files (paths or globs) holding a raw table's columns, e.g. an
    export of ``raw_<layout>``; one work unit per row group."""

    def __init__(
        self, paths: Sequence[str | Path], layout: str, *, filters: Filters | None = None
    ) -> None:
        self.patterns = [str(p) for p in paths]
        self.layout = layout
        self.filters = filters or Filters()
        self._spec: TableSpec | None = None
        self._hooks: list[str] | None = None

    def files(self) -> list[Path]:
        """Every file the patterns name, sorted; a pattern matching nothing is an error."""
        found: list[Path] = []
        for pattern in self.patterns:
            matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
            folders = [m for m in matches if Path(m).is_dir()]
            if folders:
                raise MissingSource(
                    f"corpus file {folders[0]!r} is a directory; name its files, e.g. "
                    f"{str(Path(folders[0]) / '*.parquet')!r}"
                )
            if not matches or not all(Path(m).is_file() for m in matches):
                raise MissingSource(f"corpus file {pattern!r}: no such file")
            found.extend(Path(m).resolve() for m in matches)
        return sorted(set(found))

    def identity(self) -> dict[str, Any]:
        return {
            "kind": "parquet",
            "files": [str(p) for p in self.files()],
            "layout": self.layout,
            "filters": self.filters.as_dict(),
        }

    def check(self, schema: RecordSchema) -> None:
        spec = raw_table_spec(schema.layout(self.layout), "parquet")
        for path in self.files():
            try:
                names = pq.read_schema(path).names
            except (OSError, pa.ArrowInvalid) as exc:
                raise MissingSource(f"corpus file {str(path)!r}: not Parquet ({exc})") from None
            missing = [c for c in spec.column_names if c not in names]
            if missing:
                raise LayoutMismatch(
                    f"corpus file {str(path)!r} does not hold raw records of layout "
                    f"{self.layout!r}: missing column(s) {missing} (found {names})"
                )
        self._spec = spec

    def hooks(self) -> list[str]:
        if self._hooks is None:
            names: set[str] = set()
            for path in self.files():
                column = pq.read_table(path, columns=["hook"]).column("hook")
                names.update(pc.unique(column.cast(pa.string())).to_pylist())
            self._hooks = self.filters.select_hooks(names)
        return self._hooks

    def _mask(self, table: pa.Table) -> pa.ChunkedArray:
        hooks = self.hooks()
        mask = pc.is_in(table.column("hook").cast(pa.string()), value_set=pa.array(hooks))
        f = self.filters
        for name, bounds in (("key", f.keys), ("step", f.steps)):
            if bounds is not None:
                col = table.column(name)
                mask = pc.and_(
                    mask, pc.and_(pc.greater_equal(col, bounds[0]), pc.less(col, bounds[1]))
                )
        if f.time_ns is not None:
            ts = table.column("timestamp").cast(pa.timestamp("ns")).cast(pa.int64())
            mask = pc.and_(
                mask, pc.and_(pc.greater_equal(ts, f.time_ns[0]), pc.less(ts, f.time_ns[1]))
            )
        return mask

    def plan(self, unit_rows: int) -> list[WorkUnit]:
        """One unit per row group (the writer chose their size; ``unit_rows`` is unused)."""
        units: list[WorkUnit] = []
        for path in self.files():
            meta = pq.ParquetFile(path).metadata
            for group in range(meta.num_row_groups):
                rows = self._read_group(path, group, columns=list(DESCRIPTOR_NAMES)).num_rows
                if rows:
                    units.append(
                        WorkUnit(
                            id=unit_id(str(path), meta.serialized_size, group, self.layout),
                            source=str(path),
                            rows=rows,
                            row_group=group,
                        )
                    )
        return units

    def _read_group(self, path: Path, group: int, columns: list[str]) -> pa.Table:
        table = pq.ParquetFile(path).read_row_group(group, columns=columns)
        return table.filter(self._mask(table))

    def read(self, unit: WorkUnit) -> pa.Table:
        assert self._spec is not None and unit.row_group is not None, "check() first"
        table = self._read_group(Path(unit.source), unit.row_group, self._spec.column_names)
        hooks = table.column("hook")
        if not pa.types.is_string(hooks.type):
            table = table.set_column(0, "hook", hooks.cast(pa.string()))
        order = pc.sort_indices(
            table,
            sort_keys=[(c, "ascending") for c in ("hook", "key", "step", "seq", "timestamp")],
        )
        return table.take(order)
