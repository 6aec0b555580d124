"""Raw records whose payloads are not back to back (a padded capture in a
shared pool: holes between records) become the same Arrow columns as packed
ones: every record's own bytes, gathered in one native pass."""

from __future__ import annotations

import numpy as np

from taproute.native import make_descriptors
from taproute.routing import Layout, RecordBatch, RecordSchema
from taproute.service.sinks.clickhouse.columns import raw_table
from taproute.service.sinks.clickhouse.tables import raw_table_spec

ACTS = Layout("acts", [("values", "Array(Float32)")])
SCHEMA = RecordSchema([ACTS])


def test_records_with_holes_between_them_give_each_records_own_values():
    rows, width = 6, 8
    padded = np.arange(rows * width * 2, dtype=np.float32)  # each record has room for 2x
    lengths = np.array([width, 2 * width, 0, 3, width, 1]) * 4  # ragged, one empty
    offsets = np.arange(rows) * width * 2 * 4
    descriptors = make_descriptors(0, lengths, offsets=offsets, layout_ids=0, keys=np.arange(rows))
    batch = RecordBatch.from_buffer(descriptors, padded.view(np.uint8))
    table = raw_table(batch, ACTS, raw_table_spec(ACTS, "raw_acts"), ["h"])
    got = table.column("values").to_pylist()
    starts = offsets // 4
    expected = [padded[s : s + n // 4].tolist() for s, n in zip(starts, lengths, strict=True)]
    assert got == expected
    assert table.column("values_shape").to_pylist() == [[n // 4] for n in lengths]
