"""A producer's descriptor array is taken at the call, like its values are
checked there: reusing the array for the next batch (a preallocated descriptor
pool, the natural hot-loop pattern) must not rewrite, or invalidate, records
already accepted.  Only the payload buffer is shared until ``release``."""

from __future__ import annotations

import numpy as np

from taproute.native import make_descriptors
from taproute.routing import RecordBatch, Route, RoutingConfig
from taproute.service import CaptureSink, RoutingSink, create_record_runtime, open_routing_sink
from tests.processors import SCHEMA

VEC = SCHEMA.layout_id("vec")


def _sink(out: CaptureSink) -> RoutingSink:
    return RoutingSink(
        RoutingConfig([Route("raw", "h.*", "out")]), SCHEMA, {"out": out}, unmatched="drop"
    )


def test_reusing_the_descriptor_array_after_submit_batch_changes_nothing_accepted():
    out = CaptureSink()
    with create_record_runtime(record_sink=_sink(out)) as runtime:
        hook = runtime.bind_hook("h.0", layout="vec")
        desc = make_descriptors(hook, 16, count=4, keys=np.arange(4), layout_ids=VEC)
        runtime.submit_batch(desc, np.zeros((4, 4), np.float32))
        desc["key"] = 99  # the producer fills its array for the next batch
        desc["offset"] = 10**9  # (outside the first batch's buffer)
        report = runtime.flush()
        assert report is not None and report.routes["raw"].delivered == 4
        (batch,) = out.batches
        assert batch.descriptors["key"].tolist() == [0, 1, 2, 3]
        assert batch.descriptors["offset"].tolist() == [0, 16, 32, 48]
        out.clear()


def test_a_strided_descriptor_view_is_taken_as_its_records():
    out = CaptureSink()
    with create_record_runtime(record_sink=_sink(out)) as runtime:
        hook = runtime.bind_hook("h.0", layout="vec")
        every = make_descriptors(hook, 16, count=8, keys=np.arange(8), layout_ids=VEC)
        runtime.submit_batch(every[::2], np.zeros((8, 4), np.float32))
        runtime.flush()
        (batch,) = out.batches
        assert batch.descriptors["key"].tolist() == [0, 2, 4, 6]
        out.clear()


async def test_a_batch_built_with_from_buffer_does_not_share_the_callers_descriptors():
    out = CaptureSink()
    async with open_routing_sink(
        RoutingConfig([Route("raw", "h.*", "out")]), SCHEMA, {"out": out}, unmatched="drop"
    ) as sink:
        hook = sink.bind_hook("h.0", layout="vec")
        desc = make_descriptors(hook, 16, count=2, keys=np.arange(2), layout_ids=VEC)
        await sink.submit(RecordBatch.from_buffer(desc, np.zeros((2, 4), np.float32)))
        desc["key"] = -1
        await sink.flush()
        (batch,) = out.batches
        assert batch.descriptors["key"].tolist() == [0, 1]
        out.clear()
