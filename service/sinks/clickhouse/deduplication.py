"""The check that a destination table deduplicates retried inserts.

The sink retries a block whose reply was lost with the same
``insert_deduplication_token``; that makes the retry a no-op only on a table
that keeps a deduplication window: a MergeTree with
``non_replicated_deduplication_window > 0``, or a Replicated/Shared
MergeTree with ``replicated_deduplication_window > 0`` (the default there).
On any other table a retry after a lost reply writes the block twice, so
such a table is refused at construction unless the caller accepts
duplicates (``require_deduplication=False``, at-least-once).

A Distributed table is checked through the local table it names when this
server has it; otherwise the check cannot be made from here and the table is
refused with a message saying so.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Protocol

import attrs
import pyarrow as pa

from taproute.routing.errors import ConfigError
from taproute.service.sinks.clickhouse.transient import error_code

#: What ``create_tables=True`` gives a table, and what the messages suggest.
WINDOW = 10_000

_DISTRIBUTED = re.compile(r"^Distributed\(\s*([^,]+?)\s*,\s*([^,]+?)\s*,\s*([^,)]+?)\s*[,)]")


class NoDeduplication(ConfigError):
    """A destination table would write a retried block twice."""


class _Queries(Protocol):
    def query(self, sql: str) -> pa.Table: ...


def _literal(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _unquote(arg: str) -> str:
    return arg.strip().strip("'\"`")


def _engine(transport: _Queries, database: str | None, table: str) -> tuple[str, str] | None:
    where = _literal(database) if database else "currentDatabase()"
    result = transport.query(
        "SELECT engine, engine_full FROM system.tables "
        f"WHERE database = {where} AND name = {_literal(table)}"
    ).to_pylist()
    if not result:
        return None
    return str(result[0]["engine"]), str(result[0]["engine_full"])


def distributed_target(engine_full: str) -> tuple[str, str] | None:
    """``(database, table)`` a Distributed engine writes to, as ``system.tables``
    prints it (``Distributed('c', 'db', 'local', rand())``); database ``""``
    means the current one.  None if ``engine_full`` is not a Distributed engine."""
    found = _DISTRIBUTED.match(engine_full)
    if found is None:
        return None
    database = _unquote(found.group(2))
    return ("" if database == "currentDatabase()" else database), _unquote(found.group(3))


def window_setting(engine: str) -> str | None:
    """The merge-tree setting holding ``engine``'s deduplication window (None: it has none)."""
    if not engine.endswith("MergeTree"):
        return None
    if engine.startswith(("Replicated", "Shared")):
        return "replicated_deduplication_window"
    return "non_replicated_deduplication_window"


def _window(transport: _Queries, engine_full: str, setting: str) -> int:
    found = re.search(rf"\b{setting}\s*=\s*(\d+)", engine_full)
    if found:
        return int(found.group(1))
    default = transport.query(
        f"SELECT value FROM system.merge_tree_settings WHERE name = {_literal(setting)}"
    ).to_pylist()
    return int(default[0]["value"]) if default else 0


@attrs.frozen
class DeduplicationWindow:
    """A table's deduplication window: the setting holding it, and its size (blocks)."""

    setting: str
    size: int


#: How a :class:`ClickHouseSink` caller accepts duplicates (what the messages offer).
SINK_WAIVER = "pass require_deduplication=False to accept duplicates (at-least-once)"


def _fix(table: str, setting: str, waiver: str | None, at_least: int = 1) -> str:
    window = max(WINDOW, at_least)
    return (
        f"ALTER TABLE `{table}` MODIFY SETTING {setting} = {window}, or create it with "
        f"SETTINGS {setting} = {window}"
        + (" (as create_tables=True does)" if window == WINDOW else "")
    ) + (f"; or {waiver}" if waiver else "")


def check_deduplication(
    transport: _Queries,
    table: str,
    *,
    waiver: str | None = SINK_WAIVER,
    blocks: int = 1,
    why: str | None = None,
) -> DeduplicationWindow:
    """Raise :class:`NoDeduplication` unless ``table`` deduplicates retried inserts;
    return its window (how many of its latest blocks it remembers).

    ``waiver`` is how the caller's user can accept duplicates instead (offered
    at the end of the messages); None where they cannot.  ``blocks``: how many
    of the latest blocks a retry may repeat (the window must hold them all:
    older ones fall out of it and are written again).  ClickHouse remembers
    one entry per part an insert writes: one per partition it touches, per
    block it was cut into (``max_insert_block_size`` rows, squashed up to
    ``min_insert_block_size_rows`` / ``_bytes``), so a caller counting
    inserts must bound those (as replay's lanes do).
    """
    found = _engine(transport, None, table)
    if found is None:
        raise NoDeduplication(f"table {table!r} is not in system.tables")
    engine, engine_full = found
    label, fix_table = repr(table), table
    if engine == "Distributed":
        database, local = distributed_target(engine_full) or ("", "")
        behind = _engine(transport, database or None, local) if local else None
        if behind is None:
            raise NoDeduplication(
                f"table {table!r} is Distributed over {database + '.' if database else ''}"
                f"{local or '?'}, which this server does not have, so whether retried inserts "
                "are deduplicated cannot be checked from here: make the shards' local tables "
                "ReplicatedMergeTree (they deduplicate by default) or give them "
                f"non_replicated_deduplication_window = {WINDOW}"
                + (", then pass require_deduplication=False to vouch for them" if waiver else "")
            )
        engine, engine_full = behind
        label, fix_table = f"{table!r} (Distributed over {local!r})", local
    setting = window_setting(engine)
    if setting is None:
        raise NoDeduplication(
            f"table {label} has engine {engine}, which does not deduplicate retried inserts: "
            "a block whose reply was lost would be written twice. Use a MergeTree with "
            f"SETTINGS non_replicated_deduplication_window = {WINDOW} (as create_tables=True "
            "creates) or a ReplicatedMergeTree" + (f"; or {waiver}" if waiver else "")
        )
    window = _window(transport, engine_full, setting)
    if window <= 0:
        raise NoDeduplication(
            f"table {label} ({engine}) does not deduplicate retried inserts ({setting} "
            "is 0): a block whose reply was lost would be written twice. Run "
            + _fix(fix_table, setting, waiver)
        )
    if window < blocks:
        raise NoDeduplication(
            f"table {label} ({engine}) remembers only its last {window} block(s) ({setting} "
            f"= {window}), fewer than the {blocks} a retry may insert again"
            + (f" ({why})" if why else "")
            + ": the older ones "
            "would be written twice. Run " + _fix(fix_table, setting, waiver, blocks)
        )
    return DeduplicationWindow(setting, window)


#: Settings of an insert whose retry must be recognised whole: written as one
#: block per partition it touches, never cut further (squashed whole, not cut
#: at ``min_insert_block_size_rows`` / ``_bytes``, about a million rows or
#: 256 MB), on one insert thread, not merged into other clients' asynchronous
#: inserts (chDB turns ``async_insert`` on by default); and refused, not
#: written, when it touches more partitions than
#: ``max_partitions_per_insert_block`` (set per table by
#: :func:`partition_allowance`).
ONE_BLOCK: Mapping[str, int] = MappingProxyType(
    {
        "min_insert_block_size_rows": 2**62,
        "min_insert_block_size_bytes": 2**62,
        "max_insert_threads": 1,
        "async_insert": 0,
        "throw_on_max_partitions_per_insert_block": 1,
    }
)

#: ClickHouse's code for an insert touching more partitions than allowed
#: (TOO_MANY_PARTS, which otherwise means "merges are behind": retried).
_TOO_MANY_PARTS = 252


@attrs.frozen
class PartitionAllowance:
    """How many partitions one insert may touch so that a table's window holds
    every block of ``inserts`` inserts: ``partitions`` (``window // inserts``,
    or the server's own lower ``max_partitions_per_insert_block``, then
    ``capped``), and the insert ``settings`` that enforce it."""

    partitions: int
    capped: bool
    settings: Mapping[str, int]


def partition_allowance(transport: _Queries, window: int, inserts: int) -> PartitionAllowance:
    """The partitions one insert may touch when the table's ``window`` must hold
    ``inserts`` inserts' blocks (see :class:`PartitionAllowance`)."""
    partitions = window // max(1, inserts)
    current = {
        str(row["name"]): str(row["value"])
        for row in transport.query(
            "SELECT name, value FROM system.settings WHERE name IN "
            "('max_partitions_per_insert_block', 'throw_on_max_partitions_per_insert_block')"
        ).to_pylist()
    }
    limit = int(current.get("max_partitions_per_insert_block", "0"))  # 0: no limit
    capped = 0 < limit < partitions
    if capped:
        partitions = limit
    settings = {**ONE_BLOCK, "max_partitions_per_insert_block": partitions}
    if "throw_on_max_partitions_per_insert_block" not in current:
        # A server older than the setting always throws past the limit.
        del settings["throw_on_max_partitions_per_insert_block"]
    return PartitionAllowance(partitions, capped, MappingProxyType(settings))


def too_many_partitions(error: BaseException) -> bool:
    """Whether ``error`` is ClickHouse refusing an insert that touches more
    partitions than ``max_partitions_per_insert_block`` (nothing of it written)."""
    return error_code(error) == _TOO_MANY_PARTS and "partitions" in str(error)


class TooManyPartitions(Exception):
    """An insert touched more partitions of a table than its deduplication
    window holds for a retry (:func:`partition_allowance`): refused by
    ClickHouse with nothing written.  Not transient: the same insert is
    refused again (a spool splits it into smaller ones)."""
