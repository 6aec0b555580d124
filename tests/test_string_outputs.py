"""A processor's String column is checked value by value like its other
columns are by dtype: a value that is not a ``str`` (an int, a float, None,
bytes) is a route failure of that record (``handler_invalid``, dead-lettered),
never a write. It used to pass the layout check (the column's dtype is
object either way) and reach the ClickHouse insert, where Arrow refused the
whole block: the router latched, and the block's good rows were lost with it
(None was written as '' instead)."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from taproute.native import make_descriptors
from taproute.routing import Layout, RecordSchema, Route, RoutingConfig, stateless_processor
from taproute.routing.errors import OutputLayoutMismatch
from taproute.routing.validation import check_rows
from taproute.service import ClickHouseSink, RoutingSink, create_record_runtime

VEC = Layout("vec4", [("values", "Array(Float32)", (4,))])
LABEL = Layout("label", [("request", "Int64"), ("name", "LowCardinality(String)")])
SCHEMA = RecordSchema([VEC, LABEL])
BAD = {3: 7, 5: None, 6: 1.5}  # key -> what the processor puts in `name`


@stateless_processor("test.string_labels", input="vec4", output="label")
def string_labels(records) -> np.ndarray:
    rows = np.empty(len(records), dtype=LABEL.dtype)
    rows["request"] = records.descriptors["key"]
    rows["name"] = [BAD.get(int(k), f"r{k}") for k in records.descriptors["key"]]
    return rows


@pytest.mark.parametrize("value", [7, None, 1.5, b"\xff", ["x"]])
def test_a_string_column_holding_another_type_is_named(value):
    rows = np.empty(3, dtype=LABEL.dtype)
    rows["request"] = [1, 2, 3]
    rows["name"] = ["a", value, "c"] if not isinstance(value, list) else ["a", "b", "c"]
    if isinstance(value, list):
        rows["name"][1] = value
    with pytest.raises(
        OutputLayoutMismatch,
        match=rf"column 'name' \(LowCardinality\(String\)\) row 1: expected str, "
        rf"found {type(value).__name__}",
    ):
        check_rows(rows, LABEL, route="r", processor="p")


def test_str_and_numpy_str_values_pass():
    rows = np.empty(2, dtype=LABEL.dtype)
    rows["name"] = ["a", np.str_("b")]
    assert check_rows(rows, LABEL, route="r", processor="p") is rows


def test_bad_string_values_fail_their_records_and_the_rest_land_in_clickhouse(chdb_transport):
    table = "labels_" + uuid.uuid4().hex[:8]

    def destination() -> ClickHouseSink:
        return ClickHouseSink(
            chdb_transport,
            SCHEMA,
            rows=["label"],
            rows_table=table,
            create_tables=True,
            owns_transport=False,
        )

    given_up: list[int] = []
    sink = RoutingSink(
        RoutingConfig(
            [Route("labels", "h.*", "ch", mode="stateless", processor="test.string_labels")]
        ),
        SCHEMA,
        {"ch": destination},
        unmatched="drop",
        on_failure=lambda failure: given_up.extend(
            int(k) for k in failure.records.descriptors["key"]
        ),
    )
    with create_record_runtime(record_sink=sink) as runtime:
        hook = runtime.bind_hook("h.0", layout="vec4")
        runtime.submit_batch(
            make_descriptors(hook, 16, count=8, keys=np.arange(8), layout_ids=0),
            np.zeros((8, 4), np.float32),
        )
        report = runtime.flush()
        assert report is not None
        assert report.routes["labels"].delivered == 5
        assert report.routes["labels"].dead_lettered == 3
    assert sorted(given_up) == sorted(BAD)
    rows = chdb_transport.query(f"SELECT request, name FROM `{table}` ORDER BY request")
    assert rows.to_pylist() == [{"request": k, "name": f"r{k}"} for k in range(8) if k not in BAD]


VALUES = Layout("values_out", [("request", "Int64"), ("vals", "Array(Float32)")])


@pytest.mark.parametrize("value", [None, 5, "ab", [1.0, "x"], np.array("x"), np.float32(2)])
def test_a_variable_array_column_holding_no_array_of_numbers_is_named(value):
    """None was written as [nan], an int as [5]; text latched the router."""
    rows = np.empty(3, dtype=VALUES.dtype)
    rows["request"] = [1, 2, 3]
    for i, v in enumerate([np.ones(2, np.float32), value, [1.0, 2.0]]):
        rows["vals"][i] = v
    with pytest.raises(
        OutputLayoutMismatch,
        match=r"column 'vals' \(Array\(Float32\)\) row 1: expected an array of numbers",
    ):
        check_rows(rows, VALUES, route="r", processor="p")


def test_arrays_and_lists_of_numbers_pass_a_variable_array_column():
    rows = np.empty(3, dtype=VALUES.dtype)
    for i, v in enumerate([np.ones(2, np.float32), np.arange(3), [1.0, 2.0]]):
        rows["vals"][i] = v
    assert check_rows(rows, VALUES, route="r", processor="p") is rows


INTS = Layout("ints_out", [("vals", "Array(Int32)")])


@pytest.mark.parametrize("value", [np.array([1.7]), [1.5, 2.0]])
def test_floats_in_an_integer_array_column_are_refused_not_truncated(value):
    rows = np.empty(1, dtype=INTS.dtype)
    rows["vals"][0] = value
    with pytest.raises(OutputLayoutMismatch, match=r"column 'vals' \(Array\(Int32\)\) row 0"):
        check_rows(rows, INTS, route="r", processor="p")


def test_integers_of_any_width_pass_an_integer_array_column():
    rows = np.empty(2, dtype=INTS.dtype)
    rows["vals"][0] = [1, 2]  # int64 from a list
    rows["vals"][1] = np.arange(3, dtype=np.int16)
    assert check_rows(rows, INTS, route="r", processor="p") is rows


def test_a_bfloat16_array_column_takes_float_and_bfloat16_values():
    import ml_dtypes

    layout = Layout("bf_out", [("vals", "Array(BFloat16)")])
    rows = np.empty(2, dtype=layout.dtype)
    rows["vals"][0] = np.ones(2, np.float32)
    rows["vals"][1] = np.ones(2, ml_dtypes.bfloat16)
    assert check_rows(rows, layout, route="r", processor="p") is rows
