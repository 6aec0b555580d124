"""What a ClickHouse sink keeps per table: the buffer a block accumulates in
between two inserts, and the table's counters."""

from __future__ import annotations

import math

import attrs

from taproute.routing.batch import Batch, Retained


@attrs.define
class TableCounters:
    """Per table: rows and bytes inserted, inserts done, retries, failed
    attempts, rows waiting in the buffer and rows being inserted now."""

    table: str
    records: int = 0
    bytes: int = 0
    inserts: int = 0
    retries: int = 0
    errors: int = 0
    buffered_rows: int = 0
    in_flight_rows: int = 0


class TableBuffer:
    """What one table has accumulated since its last insert."""

    __slots__ = ("bytes", "first_at", "holds", "items", "rows")

    def __init__(self) -> None:
        self.items: list[Batch] = []
        self.holds: list[Retained] = []
        self.rows = 0
        self.bytes = 0
        self.first_at = math.inf


__all__ = ["TableBuffer", "TableCounters"]
