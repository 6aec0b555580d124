"""Rows crossing to the writer process: a RowItem with String (object)
fields pickles field by field and comes back equal; the rows of each
(route, layout) in a block are joined into one item, order kept."""

from __future__ import annotations

import pickle

import numpy as np

from taproute.native import make_descriptors
from taproute.service.sinks.writer.protocol import RawItem, RowItem, coalesce_rows

DTYPE = np.dtype(
    [("request", "<i8"), ("hook", "O"), ("norms", "<f4", (3,)), ("model", "O"), ("n", "<u4")]
)


def _rows(start: int, n: int, hook: str = "gpt2.h.1") -> np.ndarray:
    rows = np.zeros(n, dtype=DTYPE)
    rows["request"] = np.arange(start, start + n)
    rows["hook"] = [f"{hook}.{i % 2}" for i in range(n)]
    rows["norms"] = np.arange(3 * n, dtype=np.float32).reshape(n, 3) + start
    rows["model"] = "gpt2"
    rows["n"] = 7
    return rows


def _equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and all(
        np.array_equal(a[name], b[name]) for name in a.dtype.names or ()
    )


def test_rows_with_string_fields_round_trip():
    for rows in (_rows(0, 5), _rows(3, 0), np.array([(1.5,), (2.5,)], dtype=[("x", "<f8")])):
        back = pickle.loads(pickle.dumps(RowItem("r", "L", rows), protocol=5))
        assert (back.route, back.layout_name) == ("r", "L")
        assert _equal(back.rows, rows)


def test_rows_of_a_route_are_joined_in_order_raw_items_kept():
    raw = RawItem(1, 0, 8, make_descriptors([0], [8]))
    items = [
        RowItem("a", "L", _rows(0, 2)),
        raw,
        RowItem("b", "L", _rows(10, 1)),
        RowItem("a", "L", _rows(2, 3)),
        RowItem("a", "M", _rows(20, 1)),
    ]
    out = coalesce_rows(items)
    assert [type(x).__name__ for x in out] == ["RowItem", "RawItem", "RowItem", "RowItem"]
    assert out[1] is raw
    assert (out[0].route, out[0].layout_name) == ("a", "L")
    assert _equal(out[0].rows, np.concatenate([_rows(0, 2), _rows(2, 3)]))
    assert out[2] is items[2] and out[3] is items[4]
    single = [RowItem("a", "L", _rows(0, 2)), raw]
    assert coalesce_rows(single) == single
