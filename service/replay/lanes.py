"""Write lanes: a processor's logical outputs mapped to tables or files.

The run's config maps each lane name to a target; the framework (never the
processor) writes a unit's rows there, exactly once across a crash and a
resume:

- ClickHouse tables get one insert per unit and lane, with the
  ``insert_deduplication_token`` ``<run id>-<unit id>-<lane>``; a resumed run
  re-inserting a unit that landed before the crash is a no-op.  ClickHouse
  remembers the last ``<window>`` blocks of a table, a block per partition an
  insert touches, per piece it cut the insert into: each insert here is
  written uncut (:data:`ONE_BLOCK`) and may touch at most ``window // inserts
  a resume may redo`` partitions (``max_partitions_per_insert_block``), so
  the window holds everything a resume repeats; a table whose window is
  shorter than those inserts is refused before the run, an insert touching
  more partitions when it is made (nothing of it written).
- Parquet directories get one file per unit and lane, ``<unit id>.parquet``,
  written to a temporary name and renamed into place: rewriting a unit
  replaces the file with the same rows.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

import attrs
import pyarrow as pa
import pyarrow.parquet as pq

from taproute.routing.layout import Layout
from taproute.service.replay.errors import NotExactlyOnce, ReplayConfigError, plain_table
from taproute.service.sinks.clickhouse.deduplication import (
    ONE_BLOCK,
    DeduplicationWindow,
    NoDeduplication,
    check_deduplication,
    partition_allowance,
    too_many_partitions,
)
from taproute.service.sinks.clickhouse.tables import (
    MissingTable,
    check_table,
    rows_table_spec,
)
from taproute.service.sinks.clickhouse.transport import Transport


@attrs.frozen
class ClickHouseTable:
    """A lane target: a table on the run's ClickHouse (created if missing)."""

    table: str = attrs.field()

    @table.validator
    def _plain(self, _attribute: attrs.Attribute[str], value: str) -> None:
        plain_table(f"output target clickhouse:{value}", value)

    def describe(self) -> str:
        return f"clickhouse:{self.table}"


@attrs.frozen
class ParquetDir:
    """A lane target: a directory of Parquet files, one per work unit."""

    path: str

    def describe(self) -> str:
        return f"parquet:{self.path}"


LaneTarget = ClickHouseTable | ParquetDir


def parse_target(text: str) -> LaneTarget:
    """``clickhouse:TABLE`` or ``parquet:DIR`` (the CLI's ``--output LANE=...``)."""
    kind, _, where = text.partition(":")
    if kind == "clickhouse" and where:
        return ClickHouseTable(where)
    if kind == "parquet" and where:
        return ParquetDir(where)
    raise ReplayConfigError(
        f"output target {text!r}: expected clickhouse:TABLE or parquet:DIRECTORY"
    )


class Lane(Protocol):
    """An open lane the driver writes to."""

    name: str
    target: LaneTarget

    def write(self, data: pa.Table, *, run_id: str, part: str) -> None:
        """Write ``data`` (a unit's rows, or the final rows) exactly once per part."""
        ...

    def count(self) -> int | None:
        """Rows the target holds now (for reports; None when unknown)."""
        ...


@attrs.frozen
class Redo:
    """The inserts into one table a resume may repeat: ``inserts``, and
    ``why`` in words (the units since the last checkpoint on every lane
    writing it, the final rows)."""

    inserts: int = 1
    why: str = "one insert"


class ClickHouseLane:
    """A lane writing into a ClickHouse table through the run's transport."""

    def __init__(
        self,
        name: str,
        target: ClickHouseTable,
        layout: Layout,
        transport: Transport,
        *,
        redo: Redo = Redo(),
    ) -> None:
        self.name = name
        self.target = target
        self.transport = transport
        self.spec = rows_table_spec(layout, target.table)
        self.redo = redo
        #: The table's deduplication window (known once prepared).
        self.window: DeduplicationWindow | None = None
        #: Partitions one insert may touch: the window over the redone inserts
        #: (capped by the server's own limit, then ``capped`` is True).
        self.partitions = 1
        self.capped = False
        #: What each insert runs with (:data:`ONE_BLOCK` and the partition limit).
        self.insert_settings: dict[str, int] = {
            **ONE_BLOCK,
            "max_partitions_per_insert_block": 1,
        }

    def prepare(self, *, create: bool) -> None:
        """Check (or create) the table; refuse one a resume could write twice to."""
        found = self.transport.describe(self.spec.name)
        if found is None:
            if not create:
                raise MissingTable(
                    f"lane {self.name!r}: output table {self.spec.name!r} does not exist in "
                    f"{self.transport.description}"
                )
            self.transport.execute(self.spec.create_sql())
            found = self.transport.describe(self.spec.name)
            assert found is not None
        try:
            check_table(self.spec, found)
        except ReplayConfigError:
            raise
        except Exception as exc:
            raise type(exc)(f"lane {self.name!r}: {exc}") from None
        inserts = max(1, self.redo.inserts)
        try:
            self.window = check_deduplication(
                self.transport, self.spec.name, waiver=None, blocks=inserts
            )
        except NoDeduplication as exc:
            raise NotExactlyOnce(
                f"lane {self.name!r}: output table {self.spec.name!r} has no deduplication "
                f"window covering the {inserts} insert(s) a resume may redo ({self.redo.why}; "
                "each insert is at least one block, one per partition it touches), so a "
                f"resumed replay could insert a unit twice ({exc})"
            ) from None
        allowance = partition_allowance(self.transport, self.window.size, inserts)
        self.partitions, self.capped = allowance.partitions, allowance.capped
        self.insert_settings = dict(allowance.settings)

    def write(self, data: pa.Table, *, run_id: str, part: str) -> None:
        token = f"{run_id}-{part}-{self.name}"
        try:
            self.transport.insert(
                self.spec.name,
                data.select(self.spec.column_names),
                dedup_token=token,
                settings=self.insert_settings,
            )
        except Exception as exc:
            if self.capped or not too_many_partitions(exc):
                raise
            raise self._too_many_partitions(part, run_id) from None

    def _too_many_partitions(self, part: str, run_id: str) -> NotExactlyOnce:
        window, inserts, allowed = self.window, max(1, self.redo.inserts), self.partitions
        assert window is not None
        rows = "the final rows" if part == "final" else f"the rows of unit {part!r}"
        return NotExactlyOnce(
            f"lane {self.name!r}: {rows} touch more than {allowed} partition(s) of output "
            f"table {self.spec.name!r}, whose {window.setting} = {window.size} holds {allowed} "
            f"per insert for the {inserts} insert(s) a resume may redo ({self.redo.why}): "
            "ClickHouse remembers a block per partition an insert touches, and a redone block "
            f"that left the window is written twice. Nothing of them was written. The window "
            f"needs {inserts} x the partitions one insert touches, at least "
            f"{inserts * (allowed + 1)}: ALTER TABLE `{self.spec.name}` MODIFY SETTING "
            f"{window.setting} = N, or lower checkpoint_units; then resume run {run_id} "
            f"(--resume {run_id})"
        )

    def count(self) -> int | None:
        result = self.transport.query(f"SELECT count() AS n FROM `{self.spec.name}`")
        return int(result.column("n")[0].as_py())


class ParquetLane:
    """A lane writing one Parquet file per part into a directory."""

    def __init__(self, name: str, target: ParquetDir, layout: Layout) -> None:
        self.name = name
        self.target = target
        self.directory = Path(target.path)
        self.spec = rows_table_spec(layout, name)

    def prepare(self, *, create: bool) -> None:
        if self.directory.exists() and not self.directory.is_dir():
            raise ReplayConfigError(
                f"lane {self.name!r}: {str(self.directory)!r} exists and is not a directory"
            )
        if create:  # a dry run creates nothing
            self.directory.mkdir(parents=True, exist_ok=True)

    def write(self, data: pa.Table, *, run_id: str, part: str) -> None:
        final = self.directory / f"{part}.parquet"
        temporary = self.directory / f".{part}.{run_id}.tmp"
        pq.write_table(data.select(self.spec.column_names), temporary)
        os.replace(temporary, final)  # atomic: a crash leaves the old file or the new one

    def count(self) -> int | None:
        files = sorted(self.directory.glob("*.parquet"))
        return int(sum(pq.ParquetFile(f).metadata.num_rows for f in files))


def open_lane(
    name: str,
    target: LaneTarget,
    layout: Layout,
    transport: Transport | None,
    *,
    redo: Redo = Redo(),
) -> ClickHouseLane | ParquetLane:
    """The lane ``name`` writing ``layout`` rows to ``target`` (``redo``: the
    inserts into its table a resume may repeat)."""
    if isinstance(target, ParquetDir):
        return ParquetLane(name, target, layout)
    if transport is None:
        raise ReplayConfigError(
            f"lane {name!r} writes to ClickHouse table {target.table!r}, but the run has no "
            "ClickHouse (give clickhouse= a chDB directory or a server URL)"
        )
    return ClickHouseLane(name, target, layout, transport, redo=redo)


def describe_targets(targets: dict[str, LaneTarget]) -> dict[str, Any]:
    """Lane -> target text, for the ledger and the config hash."""
    return {lane: target.describe() for lane, target in sorted(targets.items())}
