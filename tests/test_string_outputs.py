"""A processor's String column is checked value by value like its other
columns are by dtype: a value that is not a ``str`` (an int, a float, None,
bytes) is a route failure of that record (``handler_invalid``, dead-lettered),
never a write. It used to pass the layout check (the column's dtype is
object either way) and reach the ClickHouse insert, where Arrow refused the
whole block: the router latched, and the block's good rows were lost with it
(None was written as '' instead)."""

from __future__ import annotations

import re
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


def _route_eight_records_into_chdb(chdb_transport, schema, layout, processor, table):
    """Eight records (keys 0..7) through one stateless route calling
    ``processor`` into a chDB table of ``layout``; returns the route's flush
    report and ``(key, error message)`` for each record given up."""
    failures: list[tuple[int, str]] = []

    def destination() -> ClickHouseSink:
        return ClickHouseSink(
            chdb_transport,
            schema,
            rows=[layout],
            rows_table=table,
            create_tables=True,
            owns_transport=False,
        )

    sink = RoutingSink(
        RoutingConfig([Route("r", "h.*", "ch", mode="stateless", processor=processor)]),
        schema,
        {"ch": destination},
        unmatched="drop",
        on_failure=lambda failure: failures.extend(
            (int(k), str(failure.error)) for k in failure.records.descriptors["key"]
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
    return report.routes["r"], failures


def test_bad_string_values_fail_their_records_and_the_rest_land_in_clickhouse(chdb_transport):
    table = "labels_" + uuid.uuid4().hex[:8]
    report, failures = _route_eight_records_into_chdb(
        chdb_transport, SCHEMA, "label", "test.string_labels", table
    )
    assert report.delivered == 5
    assert report.dead_lettered == 3
    assert sorted(k for k, _ in failures) == sorted(BAD)
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


# -- values that do not fit a variable Array column's element type ---------------
#
# Same-kind values (int64 into Int32, float64 into Float32) passed the check
# above, and the ClickHouse sink's np.asarray(value, dtype=T) then narrowed
# them silently: 2**31 wrapped to -2**31, 1e300 became inf.  They must be
# refused like a wrong type, naming column, row, the expected type and the value.

UINTS = Layout("uints_out", [("vals", "Array(UInt8)")])
INT64S = Layout("int64s_out", [("vals", "Array(Int64)")])
BF16S = Layout("bf16s_out", [("vals", "Array(BFloat16)")])


@pytest.mark.parametrize(
    ("layout", "value", "shown"),
    [
        (INTS, [1, 2**31], r"2147483648"),
        (INTS, np.array([[0, -(2**31) - 1]]), r"-2147483649"),
        (INTS, np.array([2**40], np.uint64), r"1099511627776"),
        (INT64S, np.array([2**63], np.uint64), r"9223372036854775808"),
        (UINTS, [3, 256], r"256"),
        (UINTS, [-1], r"-1"),
        (VALUES, [1.0, 1e300], r"1e\+300"),
        (VALUES, np.array([-1e39]), r"-1e\+39"),
        (BF16S, np.array([3.4e38], np.float32), r"3\.4e\+38"),
    ],
)
def test_array_values_that_do_not_fit_the_element_type_are_refused_not_narrowed(
    layout, value, shown
):
    rows = np.empty(3, dtype=layout.dtype)
    for i, v in enumerate([[1], [2, 3], [4]]):
        rows[layout.columns[-1].name][i] = v
    rows["vals"][1] = value
    column = layout.columns[-1]
    with pytest.raises(OutputLayoutMismatch) as caught:
        check_rows(rows, layout, route="r", processor="p")
    message = str(caught.value)
    assert f"column 'vals' ({column.type}) row 1: expected values that fit" in message
    assert f" {column.element_dtype}" in message
    assert re.search(rf"found {shown} ", message), message


def test_array_values_that_fit_pass_whatever_their_dtype():
    rows = np.empty(4, dtype=INTS.dtype)
    rows["vals"][0] = [2**31 - 1, -(2**31)]  # int64 at Int32's bounds
    rows["vals"][1] = np.array([7], np.uint64)
    rows["vals"][2] = np.array([True, False])
    rows["vals"][3] = np.empty(0, np.int64)
    assert check_rows(rows, INTS, route="r", processor="p") is rows
    uints = np.empty(1, dtype=UINTS.dtype)
    uints["vals"][0] = [0, 255]  # a list of ints (int64) that fits UInt8
    assert check_rows(uints, UINTS, route="r", processor="p") is uints
    floats = np.empty(1, dtype=VALUES.dtype)
    floats["vals"][0] = [3.4e38, -3.4e38, 1e-50, np.inf, -np.inf, np.nan]  # no overflow
    assert check_rows(floats, VALUES, route="r", processor="p") is floats


WIDE = {2: 2**31, 5: -(2**40)}  # key -> a value that does not fit Int32


@stateless_processor("test.wide_ints", input="vec4", output="ints_out")
def wide_ints(records) -> np.ndarray:
    rows = np.empty(len(records), dtype=INTS.dtype)
    for i, k in enumerate(records.descriptors["key"].tolist()):
        rows["vals"][i] = [k, WIDE.get(k, k + 1)]  # a list of Python ints: int64
    return rows


def test_an_array_value_too_wide_fails_its_record_and_the_rest_land(chdb_transport):
    table = "wide_" + uuid.uuid4().hex[:8]
    report, failures = _route_eight_records_into_chdb(
        chdb_transport, RecordSchema([VEC, INTS]), "ints_out", "test.wide_ints", table
    )
    assert report.delivered == 6
    assert report.dead_lettered == 2
    assert sorted(k for k, _ in failures) == sorted(WIDE)
    assert all("column 'vals' (Array(Int32))" in m and "fit int32" in m for _, m in failures)
    rows = chdb_transport.query(f"SELECT vals FROM `{table}` ORDER BY vals[1]")
    assert rows.to_pylist() == [{"vals": [k, k + 1]} for k in range(8) if k not in WIDE]
