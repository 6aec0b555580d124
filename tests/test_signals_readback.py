"""Read-back helpers: filters, both shape encodings, clear errors."""

from __future__ import annotations

import numpy as np
import pytest

from taproute.service import ReadBackError, load_captures, load_rows
from taproute.service.signals.common import tail_layout
from taproute.service.sinks.clickhouse.tables import raw_table_spec

TABLE = "rb_raw_values"


@pytest.fixture
def raw(chdb_transport):
    spec = raw_table_spec(tail_layout("values"), TABLE)
    chdb_transport.execute(f"DROP TABLE IF EXISTS `{TABLE}`")
    chdb_transport.execute(spec.create_sql())
    rows = []
    for hook in ("model.layers.0.out", "model.layers.1.out", "head"):
        for key in range(3):
            for step in range(4):
                values = [float(key * 100 + step * 10 + i) for i in range(6)]
                # Layer 1 was written with its real shape, the rest flat (older tables).
                shape = [3, 2] if ".1." in hook else [6]
                rows.append(f"('{hook}', 0, {key}, {step}, 0, now64(9), {values}, {shape})")
    chdb_transport.execute(f"INSERT INTO `{TABLE}` VALUES {', '.join(rows)}")
    return chdb_transport


def test_filters_select_by_hook_glob_key_step_range_and_layer(raw):
    got = load_captures(raw, TABLE, hook="model.layers.*", key=[0, 2], steps=(1, 3), width=2)
    assert [(c.hook, c.key, c.step) for c in got] == [
        (hook, key, step)
        for hook in ("model.layers.0.out", "model.layers.1.out")
        for key in (0, 2)
        for step in (1, 2)
    ]
    layer1 = load_captures(raw, TABLE, layer=1)
    assert {c.hook for c in layer1} == {"model.layers.1.out"} and len(layer1) == 12
    assert load_captures(raw, TABLE, hook="nothing") == []


def test_real_shape_restored_from_either_encoding(raw):
    (flat,) = load_captures(raw, TABLE, hook="model.layers.0.out", key=2, steps=(3, 4), width=2)
    (shaped,) = load_captures(raw, TABLE, hook="model.layers.1.out", key=2, steps=(3, 4))
    expected = np.arange(230, 236, dtype=np.float32).reshape(3, 2)
    np.testing.assert_array_equal(flat.values, expected)
    np.testing.assert_array_equal(shaped.values, expected)
    (as_tensor,) = load_captures(raw, TABLE, hook="head", key=0, steps=(0, 1), as_torch=True)
    assert tuple(as_tensor.values.shape) == (6,)  # no width: the flat shape as stored


def test_width_that_does_not_divide_is_an_error_naming_the_record(raw):
    with pytest.raises(
        ReadBackError, match=r"hook='head' key=0 has 6 values, not a multiple of width 4"
    ):
        load_captures(raw, TABLE, hook="head", width=4)


def test_rows_filters_need_the_columns_the_layout_has(raw):
    from taproute.service.signals import twonn

    with pytest.raises(ReadBackError, match="has no 'key' column"):
        load_rows(raw, "whatever", twonn.SIGNALS.outputs[0], key=3)


def test_a_missing_table_or_a_hook_that_is_not_a_name_is_a_read_back_error(raw):
    """Not chDB's UNKNOWN_TABLE exception, nor a TypeError from inside the filter."""
    from taproute.service.signals import twonn

    with pytest.raises(ReadBackError, match=r"table 'rb_nope' does not exist in chDB at "):
        load_captures(raw, "rb_nope")
    with pytest.raises(ReadBackError, match=r"table 'rb_nope' does not exist"):
        load_rows(raw, "rb_nope", twonn.SIGNALS.outputs[0])
    with pytest.raises(ReadBackError, match=r"hook must be a name or a glob \(str\), got int"):
        load_captures(raw, TABLE, hook=5)  # type: ignore[arg-type]
    assert len(load_captures(raw, TABLE, hook="head", key=0)) == 4


@pytest.mark.parametrize(
    ("filters", "named"),
    [
        ({"key": 1.5}, "key"),
        ({"key": [0, 2.7]}, "key"),
        ({"steps": (0.5, 3)}, "steps"),
        ({"layer": "x"}, "layer"),
        ({"layer": 1.9}, "layer"),
        ({"key": True}, "key"),
    ],
)
def test_a_filter_that_is_not_an_integer_is_refused_by_name(raw, filters, named):
    """``key=1.5`` read key 1 and ``layer=1.9`` layer 1 (silently rounded);
    ``layer="x"`` was int()'s bare ValueError."""
    with pytest.raises(ReadBackError, match=rf"^{named} must be integers, got "):
        load_captures(raw, TABLE, **filters)


def test_names_and_order_by_are_names_not_sql(raw):
    """load_rows(order_by="key; DROP TABLE t") ran the DROP (chDB takes several
    statements): read-back dropped the table it read. A table or column name
    holding a backquote ended the quoted name the same way. Names are now
    plain identifiers and order_by is column names with ASC/DESC; the table
    is still there afterwards."""
    from taproute.routing import Layout

    layout = Layout("positions", [("key", "Int64"), ("step", "Int64")])
    with pytest.raises(ReadBackError, match=r"order_by takes column names, .* got 'key; DROP"):
        load_rows(raw, TABLE, layout, order_by=f"key; DROP TABLE {TABLE}")
    with pytest.raises(ReadBackError, match=r"order_by names 'nope', not a column read"):
        load_rows(raw, TABLE, layout, order_by="key, nope DESC")
    with pytest.raises(ReadBackError, match=r"table must be a plain name .* got 'rb` WHERE"):
        load_captures(raw, "rb` WHERE 1=1 --")
    with pytest.raises(ReadBackError, match=r"column must be a plain name"):
        load_captures(raw, TABLE, column="values` FROM x --")
    assert len(load_captures(raw, TABLE)) == 36  # the table was not touched
    ordered = load_rows(raw, TABLE, layout, key=[1, 2], order_by="key DESC, step asc")
    got = [(int(r["key"]), int(r["step"])) for r in ordered]
    assert got == sorted(got, key=lambda ks: (-ks[0], ks[1])) and len(got) == 24


def test_a_table_of_another_kind_or_steps_not_a_pair_is_a_read_back_error(raw):
    """A processor table read as captures, or rows read with another layout,
    raised chDB's UNKNOWN_IDENTIFIER; steps=5 raised "cannot unpack
    non-iterable int object"."""
    from taproute.service.signals import twonn

    layout = twonn.SIGNALS.outputs[0]
    with pytest.raises(ReadBackError, match=rf"{TABLE}: no columns? '.*' \(layout '{layout.name}'"):
        load_rows(raw, TABLE, layout)
    with pytest.raises(ReadBackError, match=rf"{TABLE}: no columns 'norms', 'norms_shape' "):
        load_captures(raw, TABLE, column="norms")
    with pytest.raises(ReadBackError, match=r"steps must be a \(first, stop\) pair.* got 5"):
        load_captures(raw, TABLE, steps=5)  # type: ignore[arg-type]


def test_width_on_records_stored_with_their_shape_must_match_it(raw):
    """``width`` was ignored on records written with their real shape (layer 1
    here, ``[3, 2]``): ``width=3`` returned ``[3, 2]`` arrays as if it had been
    honoured. A width that agrees with the stored shape (values per position)
    is accepted; another is refused, naming ``width`` and the stored shape."""
    (shaped,) = load_captures(raw, TABLE, hook="model.layers.1.out", key=2, steps=(3, 4), width=2)
    assert shaped.values.shape == (3, 2)
    with pytest.raises(ReadBackError) as refused:
        load_captures(raw, TABLE, hook="model.layers.1.out", key=2, steps=(3, 4), width=3)
    assert str(refused.value) == (
        f"{TABLE}: width=3 does not match record hook='model.layers.1.out' key=2, stored "
        "with its shape [3, 2] (values_shape): 2 values per position; width only reshapes "
        "records stored flat (a one-dimensional values_shape): leave it out, or give 2"
    )


@pytest.mark.parametrize("width", [0, -2, 2.0, "2", True])
def test_a_width_that_is_not_a_positive_integer_is_refused_by_name(raw, width):
    """``width=0`` was a bare ZeroDivisionError, ``width="2"`` a TypeError."""
    with pytest.raises(ReadBackError, match=r"^width must be a positive integer, got "):
        load_captures(raw, TABLE, hook="head", width=width)
