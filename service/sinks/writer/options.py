"""The table keywords of ``WriterProcessSink.embedded``/``server`` made into a
:class:`~.protocol.WriterConfig`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from taproute.routing.errors import ConfigError
from taproute.routing.schema import RecordSchema, expect_schema
from taproute.service.sinks.clickhouse import arguments
from taproute.service.sinks.clickhouse.batching import Batching
from taproute.service.sinks.writer.protocol import WriterConfig


def writer_config(
    kind: str, where: str, schema: RecordSchema, kwargs: dict[str, Any]
) -> WriterConfig:
    """A :class:`WriterConfig` from the table keywords in ``kwargs`` (removed from it)."""
    expect_schema(schema, f"WriterProcessSink.{'embedded' if kind == 'chdb' else 'server'}")
    # The ClickHouseSink's own checks, here where they are taken (its
    # constructor runs in the writer process, behind a start).
    arguments.check_kinds(
        batching=kwargs.get("batching"),
        retry=kwargs.get("retry"),
        create_tables=kwargs.get("create_tables", False),
        require_deduplication=kwargs.get("require_deduplication", True),
    )
    batching = kwargs.get("batching") or Batching()
    table_options = {
        name: kwargs.pop(name)
        for name in ("create_tables", "raw_table", "rows_table", "require_deduplication")
        if name in kwargs
    }
    nice = kwargs.pop("nice", 0)
    if isinstance(nice, bool) or not isinstance(nice, int) or not 0 <= nice <= 19:
        raise ConfigError(f"WriterProcessSink nice must be an int from 0 to 19, got {nice!r}")
    return WriterConfig(
        kind=kind,
        nice=nice,
        where=where,
        schema=schema,
        raw=tuple(table_names(kwargs.pop("raw", ()), "raw")),
        rows=tuple(table_names(kwargs.pop("rows", ()), "rows")),
        inserts_in_flight=batching.inserts_in_flight,
        **table_options,
    )


def table_names(value: Iterable[str], key: str = "raw") -> list[str]:
    return list(arguments.layouts(key, value))
