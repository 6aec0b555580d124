"""Layouts, schema and route configuration: bad input fails at build, naming the thing."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from taproute.actors import RoutingSink
from taproute.routing import (
    Column,
    ConfigError,
    DuplicateProcessor,
    DuplicateRouteName,
    GlobMatchesNothing,
    HookBindingError,
    HookRegistry,
    Layout,
    LayoutError,
    ProcessorRegistry,
    RecordSchema,
    Route,
    RoutingConfig,
    SlotSpec,
    UnknownDestination,
    UnknownLayout,
    UnknownProcessor,
    stateless_processor,
)
from taproute.service import CaptureSink
from tests.processors import SCHEMA


def test_layout_maps_clickhouse_types_to_numpy():
    layout = Layout(
        "all",
        [
            ("a", "Int8"),
            ("b", "UInt64"),
            ("c", "Float32"),
            ("d", "LowCardinality(FixedString(4))"),
            ("e", "DateTime64(6)"),
            ("f", "Array(Float64)", (2, 3)),
            ("g", "Bool"),
        ],
    )
    assert layout.dtype == np.dtype(
        [
            ("a", "i1"),
            ("b", "<u8"),
            ("c", "<f4"),
            ("d", "S4"),
            ("e", "<M8[us]"),
            ("f", "<f8", (2, 3)),
            ("g", "?"),
        ]
    )
    assert layout.is_fixed


def test_variable_tail_layout():
    layout = Layout("tok", [("pos", "UInt32"), ("hidden", "Array(Float32)")])
    assert not layout.is_fixed and layout.prefix_size == 4
    assert layout.tail == Column("hidden", "Array(Float32)")
    layout.check_payload_layout()


@pytest.mark.parametrize(
    ("columns", "message"),
    [
        (
            [("x", "Decimal(10, 2)")],
            r"layout 'bad', column 'x': ClickHouse type 'Decimal\(10, 2\)'",
        ),
        ([("x", "Nullable(Int8)")], "column 'x'"),
        ([("x", "Int8"), ("x", "Int16")], "duplicate column 'x'"),
        ([], "has no columns"),
    ],
)
def test_layouts_that_do_not_map_to_numpy_fail(columns, message):
    with pytest.raises(LayoutError, match=message):
        Layout("bad", columns)


def test_payload_layout_needs_bytes_not_strings():
    with pytest.raises(LayoutError, match="column 'name'.*no fixed byte encoding"):
        Layout("p", [("name", "String")]).check_payload_layout()
    with pytest.raises(LayoutError, match="column 'v'.*only be the last column"):
        Layout("p", [("v", "Array(Int8)"), ("x", "Int8")]).check_payload_layout()


def test_schema_lookup_and_unknown_layout():
    assert SCHEMA.layout_id("vec") == 0
    assert SCHEMA.by_id(1).name == "norm"
    with pytest.raises(UnknownLayout, match="unknown layout 'nope'; the schema defines"):
        SCHEMA.layout("nope")
    with pytest.raises(ConfigError, match="duplicate layout name 'vec'"):
        RecordSchema([SCHEMA.layout("vec"), SCHEMA.layout("vec")])


def sink_for(routes, **kwargs):
    kwargs.setdefault("default_destination", "cap")
    return RoutingSink(RoutingConfig(routes), SCHEMA, {"cap": CaptureSink()}, **kwargs)


def test_unknown_processor_names_route_and_processor():
    with pytest.raises(UnknownProcessor, match="route 'r': unknown processor 'nope'"):
        sink_for([Route("r", "x", "cap", mode="stateless", processor="nope")])


def test_unknown_destination_names_route_and_destination():
    with pytest.raises(UnknownDestination, match="route 'r': unknown destination 'db'"):
        sink_for([Route("r", "x", "db")])
    with pytest.raises(UnknownDestination, match="default_destination 'db'"):
        sink_for([], default_destination="db")


def test_duplicate_route_names():
    with pytest.raises(DuplicateRouteName, match="duplicate route name 'r'"):
        RoutingConfig([Route("r", "x", "cap"), Route("r", "y", "cap")])


def test_no_default_destination_needs_explicit_drop():
    with pytest.raises(ConfigError, match="unmatched='drop'"):
        sink_for([], default_destination=None)
    sink = sink_for([], default_destination=None, unmatched="drop")
    assert sink.plan.unmatched == "drop"


def test_route_shape_errors():
    with pytest.raises(ConfigError, match="forward route takes no processor"):
        Route("r", "x", "cap", processor="test.norms")
    with pytest.raises(ConfigError, match="mode 'stateless' needs a processor"):
        Route("r", "x", "cap", mode="stateless")
    with pytest.raises(ConfigError, match="workers must be a positive int"):
        Route("r", "x", "cap", workers=0)
    with pytest.raises(ConfigError, match="expected one of 'forward', .*found 'sideways'"):
        Route("r", "x", "cap", mode="sideways")
    with pytest.raises(ConfigError, match="needs a stateful processor, but 'test.norms'"):
        sink_for([Route("r", "x", "cap", mode="stateful", processor="test.norms")])
    with pytest.raises(ConfigError, match="17 owners for key_range 16"):
        sink_for(
            [Route("r", "x", "cap", mode="stateful", processor="test.running_sum", workers=17)]
        )


def test_glob_matching_nothing_warns_but_builds():
    hooks = HookRegistry()
    hooks.bind("layers.0.attn.q")
    with pytest.warns(GlobMatchesNothing, match=r"route 'k': output 'layers\.\*\.attn\.k'"):
        sink = sink_for([Route("k", "layers.*.attn.k", "cap")], hooks=hooks)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sink_for([Route("q", "layers.*.attn.q", "cap")], hooks=hooks)
    # A hook bound later still resolves.
    late = hooks.bind("layers.3.attn.k")
    assert sink._gen.table.routes_of(late) == (0,)


def test_processor_registry_refuses_a_second_function_under_one_name():
    registry = ProcessorRegistry()

    @stateless_processor("p", input="vec", output="norm", registry=registry)
    def first(records):
        return None

    with pytest.raises(DuplicateProcessor, match="processor name 'p' is already registered"):

        @stateless_processor("p", input="vec", output="norm", registry=registry)
        def second(records):
            return None

    with pytest.raises(ConfigError, match="SlotSpec shape must be positive"):
        SlotSpec((0,))


@pytest.mark.parametrize("shape", ["abc", (), (2.5,), (True,), None])
def test_a_slot_shape_that_is_not_ints_is_refused_naming_it(shape):
    # "abc" gave int()'s bare "invalid literal", () a zero-sized slot.
    with pytest.raises(ConfigError, match="SlotSpec shape: expected an int"):
        SlotSpec(shape)


@pytest.mark.parametrize("dtype", ["object", "U8", "datetime64[ns]", [("a", "f4")]])
def test_a_slot_dtype_that_is_not_numeric_is_refused(dtype):
    # A slot of Python objects was accepted (a K x N state region holds numbers).
    with pytest.raises(ConfigError, match="expected a numeric dtype"):
        SlotSpec((2,), dtype)
    assert SlotSpec((2,), "int32").dtype == "int32"


@pytest.mark.parametrize("name", ["", None, 5])
def test_a_layout_without_a_name_is_refused(name):
    with pytest.raises(LayoutError, match="layout name: expected a non-empty str"):
        Layout(name, [("x", "Float32")])


def test_hook_binding_is_stable_and_checks_layout():
    hooks = HookRegistry()
    a = hooks.bind("a", layout="vec")
    assert hooks.bind("a") == a and hooks.bind("a", layout="vec") == a
    assert hooks.bind("b") == a + 1
    with pytest.raises(HookBindingError, match="hook 'a' is bound with layout 'vec', not 'norm'"):
        hooks.bind("a", layout="norm")
    with pytest.raises(HookBindingError, match="non-empty string"):
        hooks.bind("")
