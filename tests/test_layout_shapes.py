"""A column's ``shape`` is checked when the layout is built, in Python as in a
config file: positive integer dimensions, on ``Array(T)`` columns only.  A
zero dimension made a 0-byte layout whose records were accepted at any size
(16 and 32 bytes against 0); a negative one failed later in numpy without
naming the layout; a float was truncated; a shape on a scalar column ignored."""

from __future__ import annotations

import numpy as np
import pytest

from taproute.routing import Layout, LayoutError, Route, RoutingConfig
from taproute.service import CaptureSink, RecordSchema, RoutingSink, create_record_runtime


@pytest.mark.parametrize(
    ("shape", "found"),
    [
        ((0,), r"\(0,\)"),
        ((4, 0), r"\(4, 0\)"),
        ((-1,), r"\(-1,\)"),
        ((2.5,), r"\(2.5,\)"),
        ((True,), r"\(True,\)"),
        ((2**31 + 1,), str(2**31 + 1)),
    ],
)
def test_a_shape_that_is_not_positive_integers_is_refused_naming_layout_and_column(shape, found):
    with pytest.raises(LayoutError, match=rf"layout 'q', column 'values': shape .*{found}"):
        Layout("q", [("values", "Array(Float32)", shape)])


def test_a_shape_on_a_scalar_column_is_refused():
    with pytest.raises(LayoutError, match=r"layout 'q', column 'norm': .*Array"):
        Layout("q", [("norm", "Float32", (4,))])


def test_good_shapes_still_build_and_integers_of_numpy_are_taken():
    layout = Layout("q", [("values", "Array(Float32)", (np.int64(16), 4))])
    assert layout.columns[0].shape == (16, 4)
    assert layout.dtype.itemsize == 16 * 4 * 4
    assert Layout("v", [("values", "Array(Float32)")]).tail is not None  # variable: no shape


def test_records_of_a_layout_are_held_to_its_size():
    schema = RecordSchema([Layout("q", [("values", "Array(Float32)", (1,))])])
    out = CaptureSink()
    sink = RoutingSink(
        RoutingConfig([Route("raw", "h.*", "out")]), schema, {"out": out}, unmatched="drop"
    )
    with create_record_runtime(record_sink=sink) as runtime:
        hook = runtime.bind_hook("h.0", layout="q")
        with pytest.raises(Exception, match=r"does not fit layout 'q'"):
            runtime.submit(hook, np.zeros(4, np.float32))
        runtime.submit(hook, np.zeros(1, np.float32))
        report = runtime.flush()
        assert report is not None and report.routes["raw"].delivered == 1
        out.clear()
