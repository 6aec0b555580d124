"""A payload array's dtype meets its layout: the element type, raw bytes, or
an exact conversion of a single record; anything else is refused naming the
record, hook, layout and both dtypes, before anything of the batch is taken.

Payloads are bytes: a float64 array handed in for an ``Array(Float32)``
layout used to be read as float32 garbage when its size happened to fit
(two float64 values are the 16 bytes of four float32)."""

from __future__ import annotations

import numpy as np
import pytest

from taproute.native import make_descriptors
from taproute.routing import Layout, RecordBatch, RecordSchema, RoutingConfig
from taproute.routing.errors import PayloadDtypeMismatch, RecordError
from taproute.routing.routes import Route
from taproute.service import CaptureSink, RoutingSink, create_record_runtime, open_routing_sink

SCHEMA = RecordSchema(
    [
        Layout("vec", [("values", "Array(Float32)", (4,))]),
        Layout("ids", [("values", "Array(Int32)", (2,))]),
        Layout("mixed", [("request", "Int64"), ("norm", "Float64")]),
    ]
)
VEC = SCHEMA.layout_id("vec")
IDS = SCHEMA.layout_id("ids")


def runtime_with_capture():
    capture = CaptureSink()
    sink = RoutingSink(
        RoutingConfig([Route("all", "*", "cap")]), SCHEMA, {"cap": capture}, unmatched="drop"
    )
    return capture, create_record_runtime(record_sink=sink)


def stored(capture: CaptureSink) -> list[bytes]:
    return [bytes(b.payload_of(i)) for b in capture.record_batches for i in range(len(b))]


def test_a_float64_batch_for_a_float32_layout_is_refused_and_nothing_accepted_is_lost():
    capture, runtime = runtime_with_capture()
    released: list[str] = []
    with runtime:
        q = runtime.bind_hook("layers.0.q", layout="vec")
        good = np.arange(8, dtype=np.float32).reshape(2, 4)
        runtime.submit_batch(
            make_descriptors(q, 16, count=2, layout_ids=VEC), good, lambda: released.append("ok")
        )
        wrong = np.arange(4, dtype=np.float64).reshape(2, 2)  # 16 bytes a record: sizes fit
        desc = make_descriptors(q, 16, count=2, layout_ids=VEC)
        with pytest.raises(PayloadDtypeMismatch) as caught:
            runtime.submit_batch(desc, wrong, lambda: released.append("refused"))
        runtime.flush()
        assert stored(capture) == [good[0].tobytes(), good[1].tobytes()]
        capture.clear()
    assert str(caught.value) == (
        "record 0 (hook 'layers.0.q'): layout 'vec' holds float32 values, found a payload "
        "array of float64 (its bytes would be read as float32); convert it "
        "(.astype(np.float32)), or hand in its bytes as uint8 if they already are float32"
    )
    assert isinstance(caught.value, RecordError)
    assert released == ["ok"]  # the refused batch's release is never called


def test_the_first_record_of_a_mismatched_layout_is_named_in_a_mixed_batch():
    _, runtime = runtime_with_capture()
    with runtime:
        q = runtime.bind_hook("q", layout="vec")
        ids = runtime.bind_hook("ids", layout="ids")
        desc = make_descriptors([q, q, ids], [16, 16, 8], layout_ids=[VEC, VEC, IDS])
        with pytest.raises(PayloadDtypeMismatch, match=r"^record 2 \(hook 'ids'\): layout 'ids'"):
            runtime.submit_batch(desc, np.zeros(10, np.float32))


def test_raw_bytes_and_the_element_type_are_taken_as_they_are():
    capture, runtime = runtime_with_capture()
    values = np.arange(8, dtype=np.float32).reshape(2, 4)
    with runtime:
        q = runtime.bind_hook("q", layout="vec")
        runtime.submit_batch(make_descriptors(q, 16, count=2, layout_ids=VEC), values)
        runtime.submit_batch(
            make_descriptors(q, 16, count=2, layout_ids=VEC), values.view(np.uint8)
        )
        runtime.submit_batch(make_descriptors(q, 16, count=2, layout_ids=VEC), values.tobytes())
        runtime.flush()
        assert stored(capture) == [values[0].tobytes(), values[1].tobytes()] * 3
        capture.clear()


def test_a_single_record_is_converted_where_exact_and_refused_where_not():
    capture, runtime = runtime_with_capture()
    with runtime:
        q = runtime.bind_hook("q", layout="vec")
        ids = runtime.bind_hook("ids", layout="ids")
        mixed = runtime.bind_hook("mixed", layout="mixed")
        half = np.array([0.5, -1.25, 3.0, 1e-3], dtype=np.float16)
        runtime.submit(q, half)  # float16 -> float32 is exact
        runtime.submit(ids, np.array([7, -9], dtype=np.int16))  # int16 -> int32 is exact
        row = np.zeros(1, SCHEMA.layout("mixed").dtype)
        runtime.submit(mixed, row.view(np.float64))  # a mixed layout: any array is its bytes
        refusals = {}
        for name, oid, payload in [
            ("float64", q, np.array([0.1, 0.2], dtype=np.float64)),  # 16 bytes: size fits
            ("int64", ids, np.array([1], dtype=np.int64)),  # 8 bytes: size fits
            ("int32->float32", q, np.arange(4, dtype=np.int32)),  # not exact past 2**24
        ]:
            with pytest.raises(PayloadDtypeMismatch) as caught:
                runtime.submit(oid, payload)
            refusals[name] = str(caught.value)
        runtime.flush()
        assert stored(capture) == [
            half.astype(np.float32).tobytes(),
            np.array([7, -9], np.int32).tobytes(),
            row.tobytes(),
        ]
        capture.clear()
    assert refusals["float64"].startswith(
        "hook 'q': layout 'vec' holds float32 values, found a payload array of float64"
    )
    assert refusals["int64"].startswith(
        "hook 'ids': layout 'ids' holds int32 values, found a payload array of int64"
    )
    assert "found a payload array of int32" in refusals["int32->float32"]


async def test_the_async_shell_checks_a_batch_built_from_an_array():
    capture = CaptureSink()
    async with open_routing_sink(
        RoutingConfig([Route("all", "*", "cap")]), SCHEMA, {"cap": capture}, unmatched="drop"
    ) as sink:
        q = sink.bind_hook("q", layout="vec")
        desc = make_descriptors(q, 16, count=1, layout_ids=VEC)
        with pytest.raises(PayloadDtypeMismatch, match=r"^record 0 \(hook 'q'\)"):
            await sink.submit(RecordBatch.from_buffer(desc, np.zeros(2, np.float64)))
        await sink.submit(RecordBatch.from_buffer(desc, np.ones(4, np.float32)))
        await sink.flush()
        assert stored(capture) == [np.ones(4, np.float32).tobytes()]
        capture.clear()
