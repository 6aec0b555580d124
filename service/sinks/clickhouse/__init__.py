"""ClickHouse destinations: chDB embedded, or a server through clickhouse-connect."""

from taproute.service.sinks.clickhouse.batching import Batching, Retry
from taproute.service.sinks.clickhouse.blocks import InsertAbandoned, TableCounters
from taproute.service.sinks.clickhouse.deduplication import NoDeduplication, TooManyPartitions
from taproute.service.sinks.clickhouse.sink import ClickHouseSink
from taproute.service.sinks.clickhouse.tables import (
    DESCRIPTOR_COLUMNS,
    MissingTable,
    SchemaMismatch,
    TableColumn,
    TableSpec,
)
from taproute.service.sinks.clickhouse.transport import (
    ChdbTransport,
    ServerTransport,
    ServerUnreachable,
    Transport,
)

__all__ = [
    "DESCRIPTOR_COLUMNS",
    "Batching",
    "ChdbTransport",
    "ClickHouseSink",
    "InsertAbandoned",
    "MissingTable",
    "NoDeduplication",
    "Retry",
    "SchemaMismatch",
    "ServerTransport",
    "ServerUnreachable",
    "TableColumn",
    "TableCounters",
    "TableSpec",
    "TooManyPartitions",
    "Transport",
]
