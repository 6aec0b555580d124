"""ClickHouse destinations: chDB embedded, or a server through clickhouse-connect."""

from taproute.service.clickhouse.sink import Batching, ClickHouseSink, Retry, TableCounters
from taproute.service.clickhouse.tables import (
    DESCRIPTOR_COLUMNS,
    MissingTable,
    SchemaMismatch,
    TableColumn,
    TableSpec,
)
from taproute.service.clickhouse.transport import ChdbTransport, ServerTransport, Transport

__all__ = [
    "DESCRIPTOR_COLUMNS",
    "Batching",
    "ChdbTransport",
    "ClickHouseSink",
    "MissingTable",
    "Retry",
    "SchemaMismatch",
    "ServerTransport",
    "TableColumn",
    "TableCounters",
    "TableSpec",
    "Transport",
]
