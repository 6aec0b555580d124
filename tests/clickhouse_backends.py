"""The ClickHouse engines the destination tests run against.

chDB always (in-process, one data directory for the whole test session, as
chDB allows one per process); a ClickHouse server too when
TAPROUTE_CLICKHOUSE_URL is set (e.g. http://default:@127.0.0.1:8123/default).
Each test gets its own table-name prefix, so tests never see each other's rows.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import attrs
import pyarrow as pa

from taproute.routing import RecordSchema
from taproute.service.sinks.clickhouse import ClickHouseSink, Transport

SERVER_URL = os.environ.get("TAPROUTE_CLICKHOUSE_URL")
BACKENDS = ["chdb", *(["server"] if SERVER_URL else [])]


@attrs.define
class Backend:
    name: str
    transport: Transport
    prefix: str = attrs.field(factory=lambda: "t" + uuid.uuid4().hex[:10])

    def raw(self, layout: str) -> str:
        return f"{self.prefix}_raw_{layout}"

    def rows(self, layout: str) -> str:
        return f"{self.prefix}_{layout}"

    def sink(self, schema: RecordSchema, transport: Transport | None = None, **kwargs: Any):
        kwargs.setdefault("create_tables", True)
        return ClickHouseSink(
            transport or self.transport,
            schema,
            raw_table=f"{self.prefix}_raw_{{layout}}",
            rows_table=f"{self.prefix}_{{layout}}",
            owns_transport=False,
            **kwargs,
        )

    def query(self, sql: str) -> pa.Table:
        return self.transport.query(sql.replace("{p}", self.prefix))
