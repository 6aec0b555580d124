"""Arguments a user easily gets wrong at construction are refused naming what
and where: a sink class or factory where the runtime takes a sink, a path and
a schema in the wrong order; one layout's name alone is that layout."""

from __future__ import annotations

import uuid

import pytest

from taproute.routing import Layout, RecordSchema
from taproute.service import CaptureSink, ClickHouseSink, create_record_runtime

SCHEMA = RecordSchema(
    [Layout("acts", [("values", "Array(Float32)")]), Layout("norm", [("key", "Int64")])]
)


@pytest.mark.parametrize(
    ("record_sink", "hint"),
    [
        (CaptureSink, r"the class itself; give an instance: CaptureSink\(\.\.\.\)"),
        (lambda: CaptureSink(), "a factory is taken only as a RoutingSink destination"),
        (object(), "found object"),
    ],
)
def test_the_runtime_takes_a_sink_instance_and_says_so(record_sink, hint):
    with pytest.raises(TypeError, match=f"record_sink: expected a RecordSink instance.*{hint}"):
        create_record_runtime(record_sink=record_sink, schema=SCHEMA)


def test_a_path_given_where_the_schema_goes_is_named_and_nothing_is_opened(tmp_path):
    path = tmp_path / "data"
    with pytest.raises(TypeError, match=r"ClickHouseSink.embedded\(schema, path, \.\.\.\): schema"):
        ClickHouseSink.embedded(str(path), SCHEMA, raw=["acts"])  # type: ignore[arg-type]
    assert not path.exists()


def test_one_layout_name_alone_is_that_layout(chdb_transport):
    prefix = "t" + uuid.uuid4().hex[:10]
    sink = ClickHouseSink(
        chdb_transport,
        SCHEMA,
        raw="acts",
        rows="norm",
        create_tables=True,
        raw_table=f"{prefix}_raw_{{layout}}",
        rows_table=f"{prefix}_{{layout}}",
        owns_transport=False,
    )
    assert sorted(sink.tables) == [f"{prefix}_norm", f"{prefix}_raw_acts"]


def test_a_routing_sink_names_an_argument_of_the_wrong_kind():
    """A list of routes where the RoutingConfig goes, the schema and config
    swapped, or destinations as a list raised AttributeError ('list' object has
    no attribute 'routes' / 'items'); a schema that is not a RecordSchema (a
    list of layouts, a string) was taken, and the runtime built on it started."""
    from taproute.routing import Route, RoutingConfig
    from taproute.service import RoutingSink

    routes = [Route("raw", "layers.*", "out")]
    config, sink = RoutingConfig(routes), CaptureSink()
    cases = [
        (
            lambda: RoutingSink(routes, SCHEMA, {"out": sink}),  # type: ignore[arg-type]
            r"RoutingSink: config must be a RoutingConfig .*found list",
        ),
        (
            lambda: RoutingSink(SCHEMA, config, {"out": sink}),  # type: ignore[arg-type]
            r"RoutingSink: config must be a RoutingConfig .*found RecordSchema",
        ),
        (
            lambda: RoutingSink(config, list(SCHEMA.layouts), {"out": sink}),  # type: ignore[arg-type]
            r"RoutingSink: schema must be a RecordSchema .*found list",
        ),
        (
            lambda: RoutingSink(config, "acts", {"out": sink}),  # type: ignore[arg-type]
            r"RoutingSink: schema must be a RecordSchema .*found str",
        ),
        (
            lambda: RoutingSink(config, SCHEMA, [sink]),  # type: ignore[arg-type]
            r"RoutingSink: destinations must be a mapping .*found list",
        ),
    ]
    for build, message in cases:
        with pytest.raises(TypeError, match=message):
            build()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"http": 9464},
            r"http: expected an HttpConfig \(http=HttpConfig\(port=9464\)\), found int",
        ),
        ({"http": {"port": 0}}, r"http: expected an HttpConfig .*found dict"),
        ({"dead_letters": "dl.sqlite"}, r"dead_letters: expected a DeadLetterStore .*found str"),
        ({"schema": "acts"}, r"schema: expected a RecordSchema or None, found str"),
        ({"capacity_records": 1.5}, r"capacity_records: expected an int, found float 1\.5"),
        ({"capacity_bytes": "1e6"}, r"capacity_bytes: expected an int, found str"),
        ({"coalesce_records": True}, r"coalesce_records: expected an int, found bool"),
        ({"max_block": "0.01"}, r"max_block: expected seconds \(a number\) or None, found str"),
        ({"wake_delay": None}, r"wake_delay: expected seconds \(a number\), found NoneType"),
    ],
)
def test_the_runtime_names_an_option_of_the_wrong_kind(options, message):
    """http=9464 and dead_letters=a path raised AttributeError ('int' object
    has no attribute 'max_body_bytes', 'str' object has no attribute 'hooks');
    max_block='0.01' and capacity_records='10' a bare comparison TypeError;
    capacity_records=1.5 and schema='acts' were taken. Each is refused naming
    the option, what it takes and what was found, before anything starts."""
    with pytest.raises(TypeError, match=message):
        create_record_runtime(record_sink=CaptureSink(), **{"schema": SCHEMA, **options})


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"batching": {"linger": 1.0}}, r"batching must be a Batching \(.*found dict"),
        ({"retry": 3}, r"retry must be a Retry \(.*found int 3"),
        ({"create_tables": "no"}, r"create_tables must be True or False, found str 'no'"),
        ({"raw": 5}, r"raw must be layout names \(a str or a list of str\), found int 5"),
        (
            {"raw_table": "x`; DROP TABLE t; --"},
            r"raw_table .* makes table name 'x`; DROP TABLE t; --' \(for layout 'acts'\): "
            r"it must be letters, digits and underscores",
        ),
        ({"rows_table": "out_{name}"}, r"rows_table 'out_\{name\}': unknown field \{name\}"),
    ],
)
def test_a_clickhouse_sink_argument_of_the_wrong_kind_is_refused_naming_it(
    chdb_transport, options, message
):
    """batching as a dict raised AttributeError ('dict' object has no attribute
    'inserts_in_flight'); retry=3 and create_tables='no' were taken (the
    latter as True); raw=5 raised "'int' object is not iterable"; a table
    template making no plain name went into CREATE TABLE between backquotes
    (chDB's INCORRECT_QUERY); an unknown template field raised KeyError.
    A config file refused all of these when read; Python now does too."""
    from taproute.routing import ConfigError

    given = {"raw": ["acts"], "rows": ["norm"], "create_tables": True, **options}
    with pytest.raises(ConfigError, match=rf"ClickHouseSink: {message}"):
        ClickHouseSink(chdb_transport, SCHEMA, owns_transport=False, **given)


def test_the_other_public_constructors_name_an_argument_of_the_wrong_kind(tmp_path):
    """Each raised from deep inside, or was taken and failed later:
    RecordSchema(["acts"]) "'str' object has no attribute 'name'";
    RoutingConfig(Route(...)) "'Route' object is not iterable";
    RoutingConfig(..., allow_cycles="yes") attrs' tuple-shaped TypeError;
    SnapshotCollector(5) failed at every scrape; ParkedRecordStore(path)
    "'str' object has no attribute 'path'"; SpoolingSink(name, 5, spool) and
    SpoolingSink(name, sink, "dir") were taken."""
    from taproute.routing import ConfigError, Route, RoutingConfig
    from taproute.service import (
        CausalLimits,
        DeadLetterStore,
        ParkedRecordStore,
        SnapshotCollector,
        Spool,
        SpoolConfig,
        SpoolingSink,
    )

    with pytest.raises(ConfigError, match=r"RecordSchema: layouts\[0\] must be a Layout .*str"):
        RecordSchema(["acts"])  # type: ignore[list-item]
    with pytest.raises(ConfigError, match=r"RecordSchema takes a list of Layout objects"):
        RecordSchema(Layout("acts", [("values", "Array(Float32)")]))  # type: ignore[arg-type]
    route = Route("raw", "layers.*", "out")
    with pytest.raises(ConfigError, match=r"RoutingConfig takes a list of routes .*found Route"):
        RoutingConfig(route)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"RoutingConfig: allow_cycles must be True or False"):
        RoutingConfig([route], allow_cycles="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"causal limits: redact_payload must be True or False"):
        CausalLimits(redact_payload="no")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"SnapshotCollector takes the function .*found int"):
        SnapshotCollector(5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"ParkedRecordStore\(DeadLetterStore\(path\)\)"):
        ParkedRecordStore(str(tmp_path / "parked.sqlite"))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"destination 'ch': spool must be a Spool .*found str"):
        SpoolingSink("ch", CaptureSink(), str(tmp_path / "spool"))  # type: ignore[arg-type]
    spool = Spool.open(SpoolConfig(directory=tmp_path / "spool"))
    with pytest.raises(TypeError, match=r"destination 'ch': inner must be a RecordSink"):
        SpoolingSink("ch", 5, spool)  # type: ignore[arg-type]
    store = DeadLetterStore(tmp_path / "letters.sqlite")
    ParkedRecordStore(store)  # what it takes
    store.close()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"raw": 5}, r"raw must be layout names .*found int 5"),
        ({"raw": ["acts"], "batching": {"linger": 1.0}}, r"batching must be a Batching"),
        ({"raw": ["acts"], "create_tables": "no"}, r"create_tables must be True or False"),
    ],
)
def test_a_writer_sink_names_a_table_argument_of_the_wrong_kind(tmp_path, options, message):
    """WriterProcessSink takes ClickHouseSink's table arguments, but checked
    them only in the writer process: raw=5 raised "'int' object is not
    iterable" and batching as a dict "'dict' object has no attribute
    'inserts_in_flight'" here, and create_tables='no' was taken."""
    from taproute.routing import ConfigError
    from taproute.service import WriterProcessSink

    with pytest.raises(ConfigError, match=message):
        WriterProcessSink.embedded(SCHEMA, tmp_path / "data", **options)
