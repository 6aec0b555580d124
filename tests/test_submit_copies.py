"""``submit`` copies its one record's payload (README: "`submit` copies
anyway"), so an array that is a strided view (a column of a 2-D array, every
other value) or Fortran-ordered is taken as its values, in C order, like a
dtype it converts exactly: refusing it because "a copy would be silent" was
``submit_batch``'s rule, where nothing is copied."""

from __future__ import annotations

import numpy as np

from taproute.routing import Layout, RecordSchema, Route, RoutingConfig
from taproute.service import CaptureSink, RoutingSink, create_record_runtime

SCHEMA = RecordSchema([Layout("q", [("values", "Array(Float32)", (2, 2))])])


def test_submit_takes_a_strided_or_fortran_ordered_array_as_its_values():
    out = CaptureSink()
    sink = RoutingSink(
        RoutingConfig([Route("raw", "h.*", "out")]), SCHEMA, {"out": out}, unmatched="drop"
    )
    with create_record_runtime(record_sink=sink) as runtime:
        hook = runtime.bind_hook("h.0", layout="q")
        grid = np.arange(16, dtype=np.float32).reshape(4, 4)
        runtime.submit(hook, grid[:, 1], key=1)  # a column: stride of 4 values
        runtime.submit(hook, np.asfortranarray(grid[:2, :2]), key=2)
        runtime.submit(hook, np.arange(8, dtype=np.float16)[::2], key=3)  # converted too
        report = runtime.flush()
        assert report is not None and report.routes["raw"].delivered == 3
        got = {  # the records may come in one coalesced batch or several
            int(batch.descriptors["key"][i]): np.frombuffer(batch.payload_of(i), np.float32)
            for batch in out.batches
            for i in range(len(batch))
        }
        assert got[1].tolist() == [1, 5, 9, 13]
        assert got[2].tolist() == [0, 1, 4, 5]
        assert got[3].tolist() == [0, 2, 4, 6]
        out.clear()
