"""ClickHouse destinations end to end: rows land exactly, schemas are checked,
failures are retried without duplicates, and routed == direct.

Every case that can run against a server is in this one file (hence its
length): chfacade's run_server_tests.sh, which CI runs, runs this file's
``[server]`` cases.  Cases that only need chDB or no engine at all live in
test_clickhouse_construction.py and test_clickhouse_transient.py."""

from __future__ import annotations

import base64
import ssl
import subprocess
import threading

import numpy as np
import pytest
import trio
import trio.testing
from clickhouse_connect.driver.exceptions import OperationalError

from taproute.actors import open_routing_sink
from taproute.native import make_descriptors
from taproute.routing import (
    HookRegistry,
    Layout,
    RecordBatch,
    Records,
    RecordSchema,
    Route,
    RoutingConfig,
    RoutingFailure,
    stateless_processor,
)
from taproute.routing.errors import ConfigError
from taproute.service import (
    Batching,
    MissingTable,
    NoDeduplication,
    Retry,
    SchemaMismatch,
    create_record_runtime,
)
from taproute.service.sinks.clickhouse import (
    ServerTransport,
    ServerUnreachable,
    TooManyPartitions,
)
from taproute.service.sinks.clickhouse.batching import seal_due
from taproute.service.sinks.clickhouse.columns import HookDictionary, raw_table
from tests.clickhouse_backends import SERVER_URL, Backend, FaultyProxy, FlakyTransport
from tests.thread_aware_clock import thread_aware_clock

#: Cases that need a server in front of which a proxy can inject faults:
#: they exist when TAPROUTE_CLICKHOUSE_URL is set and skip otherwise.
SERVER_ONLY = ["server"] if SERVER_URL else []

VEC = Layout("vec", [("values", "Array(Float32)", (4,))])
TOKENS = Layout("tokens", [("position", "UInt32"), ("hidden", "Array(Float32)")])
EVENT = Layout(
    "event",
    [
        ("request", "UInt64"),
        ("small", "Int8"),
        ("score", "Float64"),
        ("label", "LowCardinality(String)"),
        ("note", "String"),
        ("at", "DateTime64(6)"),
        ("vec", "Array(Float32)", (3,)),
    ],
)
SCHEMA = RecordSchema([VEC, TOKENS, EVENT])
LABELS = np.array(["low", "mid", "high"], dtype=object)


@stateless_processor("ch.events", input="vec", output="event")
def events(records: Records) -> np.ndarray:
    values = records.rows()["values"]
    desc = records.descriptors
    rows = np.empty(len(records), dtype=EVENT.dtype)
    rows["request"] = desc["key"]
    rows["small"] = (desc["seq"] % 100 - 50).astype(np.int8)
    rows["score"] = values.sum(axis=1)
    rows["label"] = LABELS[desc["seq"] % 3]
    rows["note"] = np.array([f"seq={s} é" for s in desc["seq"].tolist()], dtype=object)
    rows["at"] = (desc["timestamp_ns"] // 1000).astype("datetime64[us]")
    rows["vec"] = values[:, :3]
    return rows


def vec_batch(output_id: int, n: int, start: int = 0) -> RecordBatch:
    values = (np.arange(start, start + n, dtype=np.float32)[:, None] + np.arange(4)).astype(
        np.float32
    )
    desc = make_descriptors(
        output_id,
        16,
        count=n,
        layout_ids=SCHEMA.layout_id("vec"),
        keys=np.arange(start, start + n) % 7,
        steps=np.arange(start, start + n) * 10,
        seqs=np.arange(start, start + n),
        timestamps_ns=1_700_000_000_000_000_000 + np.arange(start, start + n) * 1_000,
    )
    return RecordBatch.from_buffer(desc, values)


def table_rows(clickhouse, sql: str) -> list[dict]:
    return clickhouse.query(sql).to_pylist()


async def test_raw_only_route_lands_exact_rows(clickhouse):
    hooks = HookRegistry()
    q = hooks.bind("layers.0.attn.q", layout="vec")
    k = hooks.bind("layers.0.attn.k", layout="vec")
    config = RoutingConfig([Route("raw", "layers.*", "ch")])
    async with open_routing_sink(
        config,
        SCHEMA,
        {"ch": lambda: clickhouse.sink(SCHEMA, raw=["vec"])},
        unmatched="drop",
        hooks=hooks,
    ) as sink:
        await sink.submit(vec_batch(q, 5))
        await sink.submit(vec_batch(k, 3, start=5))
        await sink.flush()
    rows = table_rows(
        clickhouse,
        "SELECT hook, output_id, key, step, seq, toUnixTimestamp64Nano(timestamp) AS ts, "
        "values, values_shape FROM {p}_raw_vec ORDER BY seq",
    )
    assert len(rows) == 8
    for i, row in enumerate(rows):
        assert row == {
            "hook": "layers.0.attn.q" if i < 5 else "layers.0.attn.k",
            "output_id": q if i < 5 else k,
            "key": i % 7,
            "step": i * 10,
            "seq": i,
            "ts": 1_700_000_000_000_000_000 + i * 1_000,
            "values": [float(i + j) for j in range(4)],
            "values_shape": [4],
        }
    by_hook = table_rows(
        clickhouse,
        "SELECT hook, avg(arrayAvg(values)) AS mean FROM {p}_raw_vec GROUP BY hook ORDER BY hook",
    )
    assert by_hook == [
        {"hook": "layers.0.attn.k", "mean": pytest.approx(7.5)},
        {"hook": "layers.0.attn.q", "mean": pytest.approx(3.5)},
    ]


async def test_processed_rows_land_column_for_column(clickhouse):
    hooks = HookRegistry()
    q = hooks.bind("layers.0.attn.q", layout="vec")
    config = RoutingConfig([Route("events", "*", "ch", mode="stateless", processor="ch.events")])
    async with open_routing_sink(
        config,
        SCHEMA,
        {"ch": lambda: clickhouse.sink(SCHEMA, rows=["event"])},
        unmatched="drop",
        hooks=hooks,
    ) as sink:
        batch = vec_batch(q, 6)
        await sink.submit(batch)
        await sink.flush()
    expected = events(Records(batch, VEC))
    rows = table_rows(
        clickhouse,
        "SELECT request, small, score, label, note, toUnixTimestamp64Micro(at) AS at_us, vec "
        "FROM {p}_event ORDER BY request, small",
    )
    got = sorted(rows, key=lambda r: (r["request"], r["small"]))
    want = sorted(
        (
            {
                "request": int(r["request"]),
                "small": int(r["small"]),
                "score": float(r["score"]),
                "label": r["label"],
                "note": r["note"],
                "at_us": int(r["at"].astype("int64")),
                "vec": [float(v) for v in r["vec"]],
            }
            for r in expected
        ),
        key=lambda r: (r["request"], r["small"]),
    )
    assert got == want
    types = {r["name"]: r["type"] for r in table_rows(clickhouse, "DESCRIBE TABLE {p}_event")}
    assert types["label"] == "LowCardinality(String)" and types["at"] == "DateTime64(6)"


async def test_fan_out_raw_and_processed_into_one_sink(clickhouse):
    hooks = HookRegistry()
    q = hooks.bind("layers.0.attn.q", layout="vec")
    t = hooks.bind("layers.0.tokens", layout="tokens")
    config = RoutingConfig(
        [
            Route("raw", "layers.*", "ch"),
            Route("events", "*.q", "ch", mode="stateless", processor="ch.events"),
        ]
    )
    token_payload = b"".join(
        np.array([p], np.uint32).tobytes() + np.arange(p, dtype=np.float32).tobytes()
        for p in (1, 3, 0)
    )
    tokens = RecordBatch.from_buffer(
        make_descriptors(t, [8, 16, 4], layout_ids=SCHEMA.layout_id("tokens")), token_payload
    )
    async with open_routing_sink(
        config,
        SCHEMA,
        {"ch": lambda: clickhouse.sink(SCHEMA, raw=["vec", "tokens"], rows=["event"])},
        unmatched="drop",
        hooks=hooks,
    ) as sink:
        await sink.submit(vec_batch(q, 4))
        await sink.submit(tokens)
        await sink.flush()
        counters = sink.counters()
    assert counters.routes["raw"].emitted == 7
    assert table_rows(clickhouse, "SELECT count() AS n FROM {p}_raw_vec") == [{"n": 4}]
    assert table_rows(clickhouse, "SELECT count() AS n FROM {p}_event") == [{"n": 4}]
    assert table_rows(
        clickhouse, "SELECT position, hidden, hidden_shape FROM {p}_raw_tokens ORDER BY seq"
    ) == [
        {"position": 1, "hidden": [0.0], "hidden_shape": [1]},
        {"position": 3, "hidden": [0.0, 1.0, 2.0], "hidden_shape": [3]},
        {"position": 0, "hidden": [], "hidden_shape": [0]},
    ]


async def test_mismatched_column_fails_construction_naming_it(clickhouse):
    table = clickhouse.raw("vec")
    clickhouse.transport.execute(
        f"CREATE TABLE {table} (hook LowCardinality(String), output_id UInt32, key Int64, "
        "step Int64, seq Int64, timestamp DateTime64(9), values Array(Float64), "
        "values_shape Array(UInt32)) ENGINE = MergeTree ORDER BY tuple()"
    )
    with pytest.raises(SchemaMismatch) as caught:
        clickhouse.sink(SCHEMA, raw=["vec"])
    assert str(caught.value) == (
        f"table {table!r}: column 'values' expected Array(Float32), found Array(Float64)"
    )


async def test_missing_table_without_create_tables(clickhouse):
    with pytest.raises(MissingTable, match=f"table '{clickhouse.rows('event')}' does not exist"):
        clickhouse.sink(SCHEMA, rows=["event"], create_tables=False)
    clickhouse.sink(SCHEMA, rows=["event"], create_tables=True)
    assert table_rows(clickhouse, "SELECT count() AS n FROM {p}_event") == [{"n": 0}]


async def test_failing_then_recovering_destination_loses_and_duplicates_nothing(
    clickhouse, autojump_clock
):
    hooks = HookRegistry()
    q = hooks.bind("q", layout="vec")
    flaky = FlakyTransport(clickhouse.transport, failures=3)
    ch = clickhouse.sink(
        SCHEMA, flaky, raw=["vec"], hooks=hooks, retry=Retry(attempts=5, initial_backoff=1.0)
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(ch.run)
        for i in range(4):
            await ch.submit(vec_batch(q, 10, start=10 * i))
        started = trio.current_time()
        await ch.flush()
        waited = trio.current_time() - started
        await ch.close()
    counters = ch.table_counters()[clickhouse.raw("vec")]
    assert counters.retries == 3 and counters.errors == 3 and counters.inserts == 1
    assert counters.records == 40 and counters.buffered_rows == counters.in_flight_rows == 0
    assert len(set(flaky.tokens)) == 1 and len(flaky.tokens) == 4  # one block, same token
    assert waited == pytest.approx(1.0 + 2.0 + 4.0)  # capped exponential backoff
    seqs = table_rows(clickhouse, "SELECT seq FROM {p}_raw_vec ORDER BY seq")
    assert [r["seq"] for r in seqs] == list(range(40))


async def test_exhausted_retries_latch_a_failure_naming_the_table(clickhouse, autojump_clock):
    hooks = HookRegistry()
    q = hooks.bind("q", layout="vec")
    flaky = FlakyTransport(clickhouse.transport, failures=100)
    ch = clickhouse.sink(SCHEMA, flaky, raw=["vec"], hooks=hooks, retry=Retry(attempts=3))
    async with trio.open_nursery() as nursery:
        await nursery.start(ch.run)
        await ch.submit(vec_batch(q, 2))
        with pytest.raises(RoutingFailure) as caught:
            await ch.flush()
        with pytest.raises(RoutingFailure):
            await ch.submit(vec_batch(q, 2))
        with pytest.raises(RoutingFailure):
            await ch.close()
    assert f"clickhouse table '{clickhouse.raw('vec')}'" in str(caught.value)
    where = f"insert of 2 rows into {clickhouse.transport.description} after 3 attempt(s)"
    assert where in str(caught.value)
    assert isinstance(caught.value.cause, ConnectionError)


async def test_non_transient_error_is_not_retried(clickhouse, autojump_clock):
    hooks = HookRegistry()
    q = hooks.bind("q", layout="vec")
    flaky = FlakyTransport(clickhouse.transport, failures=1, error=ValueError)
    ch = clickhouse.sink(SCHEMA, flaky, raw=["vec"], hooks=hooks)
    async with trio.open_nursery() as nursery:
        await nursery.start(ch.run)
        await ch.submit(vec_batch(q, 2))
        with pytest.raises(RoutingFailure, match="after 1 attempt"):
            await ch.flush()
        nursery.cancel_scope.cancel()
    assert ch.table_counters()[clickhouse.raw("vec")].retries == 0


async def test_batches_by_rows_and_by_linger_time(clickhouse, mock_clock):
    hooks = HookRegistry()
    q = hooks.bind("q", layout="vec")
    ch = clickhouse.sink(
        SCHEMA, raw=["vec"], hooks=hooks, batching=Batching(max_rows=25, linger=2.0)
    )
    table = clickhouse.raw("vec")
    async with trio.open_nursery() as nursery:
        await nursery.start(ch.run)
        for i in range(3):  # 30 rows: sealed at the third batch (>= 25 rows)
            await ch.submit(vec_batch(q, 10, start=10 * i))
        assert ch.counters[table].buffered_rows == 0
        assert ch.counters[table].in_flight_rows == 30
        await ch.submit(vec_batch(q, 5, start=30))
        await trio.testing.wait_all_tasks_blocked()
        assert ch.counters[table].buffered_rows == 5  # waits for more, or for linger
        mock_clock.jump(2.0)
        await trio.testing.wait_all_tasks_blocked()
        assert ch.counters[table].buffered_rows == 0  # the linger timer sealed it
        await ch.flush()
        await ch.close()
    assert ch.counters[table].inserts == 2 and ch.counters[table].records == 35


class GatedTransport:
    """The real transport, whose inserts wait until the test opens ``gate``."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.gate = threading.Event()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def insert(self, table, data, *, dedup_token, settings=None):
        assert self.gate.wait(60), "the test never opened the gate"
        self.inner.insert(table, data, dedup_token=dedup_token, settings=settings)


async def test_seals_at_early_bytes_while_no_insert_of_the_table_runs(clickhouse):
    """While a table's inserts are idle, a buffer becomes an insert at
    ``early_bytes``; while one runs, the buffer fills towards ``max_bytes``
    (so what flush() is left with is what came during the last insert)."""
    hooks = HookRegistry()
    q = hooks.bind("q", layout="vec")
    gated = GatedTransport(clickhouse.transport)
    batching = Batching(early_bytes=3 * 10 * 16, max_bytes=12 * 10 * 16, linger=3600)
    ch = clickhouse.sink(SCHEMA, gated, raw=["vec"], hooks=hooks, batching=batching)
    table = clickhouse.raw("vec")
    counters = ch.counters[table]
    async with trio.open_nursery() as nursery:
        await nursery.start(ch.run)
        for i in range(2):  # 160 bytes each: below early_bytes
            await ch.submit(vec_batch(q, 10, start=10 * i))
        assert (counters.buffered_rows, counters.in_flight_rows) == (20, 0)
        await ch.submit(vec_batch(q, 10, start=20))  # early_bytes: sealed, none running
        assert (counters.buffered_rows, counters.in_flight_rows) == (0, 30)
        for i in range(3, 8):  # past early_bytes while that insert runs: kept
            await ch.submit(vec_batch(q, 10, start=10 * i))
        assert (counters.buffered_rows, counters.in_flight_rows) == (50, 30)
        gated.gate.set()
        await ch.flush()
        assert counters.inserts == 2 and counters.records == 80
        for i in range(8, 11):  # idle again: sealed at early_bytes
            await ch.submit(vec_batch(q, 10, start=10 * i))
        assert (counters.buffered_rows, counters.in_flight_rows) == (0, 30)
        await ch.flush()
        await ch.close()
    assert counters.inserts == 3
    assert table_rows(clickhouse, f"SELECT count() AS n FROM {table}") == [{"n": 110}]


async def test_a_producer_waiting_for_room_gets_an_insert_started_not_the_linger(clickhouse):
    """With ``max_buffered_bytes`` below ``max_bytes`` and no early seal, the
    buffer reaches the room limit with no insert running: a submit waiting
    for room seals it, instead of waiting for the linger (an hour here)."""
    hooks = HookRegistry()
    q = hooks.bind("q", layout="vec")
    batching = Batching(max_bytes=100_000, max_buffered_bytes=300, linger=3600)
    ch = clickhouse.sink(SCHEMA, clickhouse.transport, raw=["vec"], hooks=hooks, batching=batching)
    table = clickhouse.raw("vec")
    counters = ch.counters[table]
    async with trio.open_nursery() as nursery:
        await nursery.start(ch.run)
        with trio.fail_after(30):  # the linger would take an hour
            for i in range(4):  # 160 bytes each: room for two
                await ch.submit(vec_batch(q, 10, start=10 * i))
        assert counters.inserts >= 1  # made room: an insert ran before the linger
        await ch.flush()
        await ch.close()
    assert table_rows(clickhouse, f"SELECT count() AS n FROM {table}") == [{"n": 40}]


def test_seal_rule():
    """Full buffers seal; early ones only while no insert runs; an
    ``early_bytes`` at ``max_bytes`` never seals early, and by default
    nothing seals early."""
    batching = Batching(max_rows=100, max_bytes=1000, early_bytes=300)
    assert seal_due(100, 10, batching, inserting=True)
    assert seal_due(1, 1000, batching, inserting=True)
    assert seal_due(1, 300, batching, inserting=False)
    assert not seal_due(1, 300, batching, inserting=True)
    assert not seal_due(99, 299, batching, inserting=False)
    never_early = Batching(max_bytes=1000, early_bytes=1000)
    assert not seal_due(1, 999, never_early, inserting=False)
    default = Batching()
    assert default.early_bytes is None
    assert not seal_due(1, default.max_bytes - 1, default, inserting=False)
    assert seal_due(1, default.max_bytes, default, inserting=False)


def test_routed_and_direct_sinks_write_identical_tables(clickhouse):
    """Parity: RoutingSink with a raw-only route vs the sink straight under the runtime."""

    def produce(runtime) -> None:
        q = runtime.bind_hook("layers.0.attn.q", layout="vec")
        k = runtime.bind_hook("layers.1.attn.q", layout="vec")
        for i in range(20):
            batch = vec_batch(q if i % 2 else k, 16, start=16 * i)
            runtime.submit_batch(batch.descriptors, batch.payload)
        runtime.flush(timeout=60)

    from taproute.actors import RoutingSink

    direct_backend = type(clickhouse)(clickhouse.name, clickhouse.transport)
    direct_sink = direct_backend.sink(SCHEMA, raw=["vec"])
    with create_record_runtime(record_sink=direct_sink) as runtime:
        produce(runtime)
    routed = RoutingSink(
        RoutingConfig([Route("raw", "layers.*", "ch")]),
        SCHEMA,
        {"ch": lambda: clickhouse.sink(SCHEMA, raw=["vec"])},
        unmatched="drop",
    )
    with create_record_runtime(record_sink=routed) as runtime:
        produce(runtime)
    columns = "hook, output_id, key, step, seq, timestamp, values, values_shape"
    a = clickhouse.query(f"SELECT {columns} FROM {direct_backend.raw('vec')} ORDER BY seq")
    b = clickhouse.query(f"SELECT {columns} FROM {{p}}_raw_vec ORDER BY seq")
    assert a.num_rows == 320
    assert a.equals(b)


def test_hook_dictionary_is_built_once_per_registry_version():
    """Inserts reuse the hook column's dictionary until a hook is bound."""
    hooks = HookRegistry()
    hooks.bind("q")
    dictionary = HookDictionary()
    first = dictionary.of(hooks.names())
    assert first.to_pylist() == ["q"]
    assert dictionary.of(hooks.names()) is first
    hooks.bind("k")
    second = dictionary.of(hooks.names())
    assert second is not first
    assert second.to_pylist() == ["q", "k"]
    assert dictionary.of(hooks.names()) is second


# -- the server path: concurrency, failure classes, credentials -------------------


def test_one_transport_takes_inserts_from_several_threads_at_once(clickhouse):
    """The sink's insert threads share one transport (on a server: one client,
    no HTTP session, which would allow one query at a time)."""
    spec = clickhouse.sink(SCHEMA, raw=["vec"]).tables[clickhouse.raw("vec")]
    blocks = [raw_table(vec_batch(0, 10, start=10 * i), VEC, spec, ["q"]) for i in range(4)]
    barrier = threading.Barrier(len(blocks))
    errors: list[BaseException] = []

    def insert(i: int) -> None:
        barrier.wait()
        try:
            clickhouse.transport.insert(spec.name, blocks[i], dedup_token=f"{spec.name}-{i}")
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=insert, args=(i,)) for i in range(len(blocks))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    seqs = table_rows(clickhouse, "SELECT seq FROM {p}_raw_vec ORDER BY seq")
    assert [r["seq"] for r in seqs] == list(range(40))


async def _insert_through(backend: Backend, retry: Retry, **options) -> tuple[object, object]:
    """Four batches of `vec` as one block through a sink on ``backend``; returns
    the sink and what flush raised."""
    hooks = HookRegistry()
    q = hooks.bind("q", layout="vec")
    ch = backend.sink(SCHEMA, raw=["vec"], hooks=hooks, retry=retry, **options)
    raised = None
    async with trio.open_nursery() as nursery:
        await nursery.start(ch.run)
        for i in range(4):
            await ch.submit(vec_batch(q, 10, start=10 * i))
        try:
            await ch.flush()
        except RoutingFailure as exc:
            raised = exc
        nursery.cancel_scope.cancel()
    return ch, raised


@pytest.mark.parametrize("backend", SERVER_ONLY)
async def test_server_overload_and_proxy_errors_are_retried_and_written_once(
    backend, autojump_clock
):
    faults = [
        ("lose_reply", 502),  # stored, but the gateway's reply is an error
        ("reply", 500, 252),  # TOO_MANY_PARTS
        ("reply", 502, None),  # a proxy with no server behind it
        ("reply", 503, 209),  # SOCKET_TIMEOUT
        ("reply", 500, 241),  # MEMORY_LIMIT_EXCEEDED
    ]
    proxy = FaultyProxy(SERVER_URL, faults)
    transport = ServerTransport(proxy.url)
    try:
        server = Backend("server", transport)
        ch, raised = await _insert_through(server, Retry(attempts=6, initial_backoff=1.0))
        assert raised is None
        counters = ch.table_counters()[server.raw("vec")]
        assert (counters.retries, counters.errors, counters.inserts) == (5, 5, 1)
        assert proxy.inserts == 6
        seqs = table_rows(server, "SELECT seq FROM {p}_raw_vec ORDER BY seq")
        assert [r["seq"] for r in seqs] == list(range(40))  # the lost reply's block once
    finally:
        transport.close()
        proxy.close()


@pytest.mark.parametrize(
    ("status", "code"), [(500, 53), (400, 27), (404, 60), (403, 497), (400, None)]
)
@pytest.mark.parametrize("backend", SERVER_ONLY)
async def test_server_bad_data_schema_or_access_is_not_retried(
    backend, status, code, autojump_clock
):
    proxy = FaultyProxy(SERVER_URL, [("reply", status, code)])
    transport = ServerTransport(proxy.url)
    try:
        server = Backend("server", transport)
        ch, raised = await _insert_through(server, Retry(attempts=6))
        assert raised is not None and "after 1 attempt" in str(raised)
        assert getattr(raised.cause, "code", None) == code
        assert ch.table_counters()[server.raw("vec")].retries == 0
        assert proxy.inserts == 1
        assert table_rows(server, "SELECT count() AS n FROM {p}_raw_vec") == [{"n": 0}]
    finally:
        transport.close()
        proxy.close()


async def test_insert_into_a_dropped_table_is_not_retried(clickhouse, autojump_clock):
    """A real error from the engine (UNKNOWN_TABLE, code 60) on either transport."""
    hooks = HookRegistry()
    q = hooks.bind("q", layout="vec")
    ch = clickhouse.sink(SCHEMA, raw=["vec"], hooks=hooks, retry=Retry(attempts=6))
    clickhouse.transport.execute(f"DROP TABLE `{clickhouse.raw('vec')}`")
    async with trio.open_nursery() as nursery:
        await nursery.start(ch.run)
        await ch.submit(vec_batch(q, 2))
        with pytest.raises(RoutingFailure, match="after 1 attempt") as caught:
            await ch.flush()
        nursery.cancel_scope.cancel()
    assert "Code: 60." in str(caught.value.cause)
    assert ch.table_counters()[clickhouse.raw("vec")].retries == 0


@pytest.mark.parametrize("backend", SERVER_ONLY)
def test_server_client_with_a_session_is_refused(backend):
    import clickhouse_connect

    client = clickhouse_connect.get_client(dsn=SERVER_URL)  # autogenerates a session
    try:
        with pytest.raises(ConfigError, match="has an HTTP session") as caught:
            ServerTransport(client)
        assert "autogenerate_session_id=False" in str(caught.value)
    finally:
        client.close()


@pytest.mark.parametrize("backend", SERVER_ONLY)
def test_server_credentials_come_from_the_environment(backend, monkeypatch):
    proxy = FaultyProxy(SERVER_URL, [])
    bare = proxy.url.replace("default:@", "")
    monkeypatch.setenv("CLICKHOUSE_USER", "ingest")
    monkeypatch.setenv("CLICKHOUSE_PASSWORD", "s3cret")
    try:
        transport = ServerTransport(bare)
        transport.query("SELECT 1")
        transport.close()
        assert proxy.authorizations == {"Basic " + base64.b64encode(b"ingest:s3cret").decode()}
        assert "s3cret" not in transport.description and "ingest" not in transport.description
        proxy.authorizations.clear()
        transport = ServerTransport(proxy.url)  # credentials in the URL win
        transport.close()
        assert proxy.authorizations == {"Basic " + base64.b64encode(b"default:").decode()}
    finally:
        proxy.close()


@pytest.mark.parametrize("backend", SERVER_ONLY)
async def test_server_over_tls_on_any_port_verifies_the_certificate(
    backend, tmp_path, autojump_clock
):
    """https:// means TLS whatever the port, with the CA given in the URL."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    proxy = FaultyProxy(SERVER_URL, [], tls=tls)
    try:
        assert proxy.url.startswith("https://") and ":443" not in proxy.url
        with pytest.raises(ServerUnreachable, match="to connect") as refused:
            ServerTransport(proxy.url)  # an unknown CA is refused
        cause = refused.value.__cause__  # the driver's error, kept
        assert isinstance(cause, OperationalError) and "CERTIFICATE_VERIFY_FAILED" in str(cause)
        transport = ServerTransport(f"{proxy.url}?ca_cert={cert}")
        try:
            server = Backend("server", transport)
            _, raised = await _insert_through(server, Retry())
            assert raised is None
            assert table_rows(server, "SELECT count() AS n FROM {p}_raw_vec") == [{"n": 40}]
        finally:
            transport.close()
    finally:
        proxy.close()


# -- tables made beforehand, and failed constructors ---------------------------------


async def test_merge_tree_without_a_deduplication_window_is_refused_saying_how(
    clickhouse, autojump_clock
):
    table = clickhouse.create_raw_vec("MergeTree ORDER BY tuple()")
    with pytest.raises(NoDeduplication) as caught:
        clickhouse.sink(SCHEMA, raw=["vec"])
    message = str(caught.value)
    assert message.startswith(
        f"table {table!r} (MergeTree) does not deduplicate retried inserts "
        "(non_replicated_deduplication_window is 0)"
    )
    fix = f"ALTER TABLE `{table}` MODIFY SETTING non_replicated_deduplication_window = 10000"
    assert fix in message and "require_deduplication=False" in message
    # The fix the message gives works: five lost replies, every row once.
    clickhouse.transport.execute(fix)
    flaky = FlakyTransport(clickhouse.transport, failures=5)
    _, raised = await _insert_through(
        Backend(clickhouse.name, flaky, clickhouse.prefix), Retry(attempts=8)
    )
    assert raised is None and len(flaky.tokens) == 6
    seqs = table_rows(clickhouse, "SELECT seq FROM {p}_raw_vec ORDER BY seq")
    assert [r["seq"] for r in seqs] == list(range(40))


def test_engine_without_deduplication_is_refused(clickhouse):
    table = clickhouse.create_raw_vec("Memory")
    with pytest.raises(NoDeduplication, match=f"table '{table}' has engine Memory, which does not"):
        clickhouse.sink(SCHEMA, raw=["vec"])


async def test_at_least_once_is_an_explicit_opt_in(clickhouse, autojump_clock):
    clickhouse.create_raw_vec("MergeTree ORDER BY tuple()")
    flaky = FlakyTransport(clickhouse.transport, failures=2)
    backend = Backend(clickhouse.name, flaky, clickhouse.prefix)
    _, raised = await _insert_through(backend, Retry(attempts=8), require_deduplication=False)
    assert raised is None
    # Two lost replies, three stored copies: at least once, as opted into.
    counts = table_rows(clickhouse, "SELECT count() AS n, uniqExact(seq) AS u FROM {p}_raw_vec")
    assert counts == [{"n": 120, "u": 40}]


# -- exactly once into partitioned tables and past ClickHouse's block size ----------
#
# ClickHouse drops a repeated insert by its deduplication token only while the
# table's window (its last <window> blocks) still holds every block of the first
# try: one per partition the insert touched, per piece it was cut into (about a
# million rows).  Between a first try and its repeat, up to 2 x inserts_in_flight
# - 1 inserts of the sink land (the default 2: 3), so the window must hold that
# many inserts' blocks.

PARTITIONED = (
    "MergeTree PARTITION BY seq % 4 ORDER BY tuple() "
    "SETTINGS non_replicated_deduplication_window = {window}"
)


def _counts(backend) -> list[dict]:
    return table_rows(backend, "SELECT count() AS n, uniqExact(seq) AS u FROM {p}_raw_vec")


@pytest.mark.parametrize("window", [12, 3])
async def test_a_retried_insert_into_a_partitioned_table_writes_each_row_once(
    clickhouse, autojump_clock, window
):
    """40 rows over 4 partitions are 4 blocks to ClickHouse.  The sink checked
    the window against one block, so a window of 3 passed, and two lost replies
    left every row twice (the repeat's first block had left the window, was
    written again and pushed the next one out).  Now each of the 3 inserts the
    window must hold (inserts_in_flight = 2) may touch window // 3 partitions:
    12 holds 4, and the repeats leave each row once; 3 holds 1, and the insert
    is refused with nothing written, not retried, naming table, window and the
    least window that would do."""
    table = clickhouse.create_raw_vec(PARTITIONED.format(window=window))
    flaky = FlakyTransport(clickhouse.transport, failures=2)
    ch, raised = await _insert_through(
        Backend(clickhouse.name, flaky, clickhouse.prefix), Retry(attempts=4)
    )
    if window == 12:
        assert raised is None and len(flaky.tokens) == 3 and len(set(flaky.tokens)) == 1
        assert _counts(clickhouse) == [{"n": 40, "u": 40}]
        return
    assert raised is not None and isinstance(raised.cause, TooManyPartitions)
    message = str(raised.cause)
    assert f"more than 1 partition(s) of table {table!r}" in message
    assert "non_replicated_deduplication_window = 3 holds 1 per insert for the 3 insert(s)" in (
        message
    )
    assert "at least 6" in message and "Nothing of it was written" in message
    assert f"ALTER TABLE `{table}` MODIFY SETTING non_replicated_deduplication_window" in message
    assert ch.table_counters()[table].retries == 0  # refused, not retried
    assert _counts(clickhouse) == [{"n": 0, "u": 0}]


@pytest.fixture
def thread_clock():
    """Autojump that never jumps while an insert runs in its thread: a retry's
    backoff then passes only once the other inserts are done, as on a server
    that answers faster than the backoff."""
    with thread_aware_clock() as clock:
        yield clock


async def test_a_repeat_finds_its_blocks_while_other_inserts_wait_their_turn(
    clickhouse, thread_clock
):
    """Five blocks of 40 rows, each over 4 partitions, into a window of 12 (3
    inserts x 4), the first reply lost.  The other slot went on inserting while
    the lost one waited for its retry, 4 blocks of 4 parts pushed its parts out
    of the window, and the retry wrote its 40 rows again (240 rows for 200).
    Now a block starts only once every block inserts_in_flight before it is
    done: the retry lands behind at most 2 other inserts, and each row is
    there once."""
    clickhouse.create_raw_vec(PARTITIONED.format(window=12))
    hooks = HookRegistry()
    q = hooks.bind("q", layout="vec")
    flaky = FlakyTransport(clickhouse.transport, failures=1)
    ch = clickhouse.sink(
        SCHEMA,
        flaky,
        raw=["vec"],
        hooks=hooks,
        batching=Batching(max_rows=40, linger=60.0),
        retry=Retry(attempts=3, initial_backoff=1.0),
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(ch.run)
        for i in range(5):
            await ch.submit(vec_batch(q, 40, start=40 * i))
        await ch.flush()
        await ch.close()
    assert len(flaky.tokens) == 6 and len(set(flaky.tokens)) == 5  # one block repeated
    assert _counts(clickhouse) == [{"n": 200, "u": 200}]


def test_a_window_shorter_than_the_inserts_a_repeat_may_follow_is_refused(clickhouse):
    """A table whose window cannot hold the inserts that may land between a
    first try and its repeat (3 with inserts_in_flight = 2) is refused when the
    sink is built, saying what it needs; one insert at a time needs 1."""
    table = clickhouse.create_raw_vec(
        "MergeTree ORDER BY tuple() SETTINGS non_replicated_deduplication_window = 2"
    )
    with pytest.raises(NoDeduplication) as caught:
        clickhouse.sink(SCHEMA, raw=["vec"])
    message = str(caught.value)
    assert f"table {table!r} (MergeTree) remembers only its last 2 block(s)" in message
    assert "fewer than the 3 a retry may insert again" in message
    assert "inserts_in_flight = 2" in message and "one per partition it touches" in message
    assert f"ALTER TABLE `{table}` MODIFY SETTING non_replicated_deduplication_window" in message
    clickhouse.sink(SCHEMA, raw=["vec"], batching=Batching(inserts_in_flight=1))


def test_a_retried_block_of_more_rows_than_clickhouse_cuts_at_is_written_once(chdb_transport):
    """ClickHouse cut an insert of more than min_insert_block_size_rows
    (1,048,449) into blocks remembered one by one: 1.1M rows were 2 blocks,
    and with one insert in flight (a window of 1 passes) a lost reply's retry
    wrote the first block again, pushing out the second: every row twice.
    The sink's inserts are written as one block: the retry leaves each row
    once.  (chDB only: 1.1M rows, the same settings on either transport.)"""
    backend = Backend("chdb", chdb_transport)
    backend.create_raw_vec(
        "MergeTree ORDER BY tuple() SETTINGS non_replicated_deduplication_window = 1"
    )
    flaky = FlakyTransport(chdb_transport, failures=1)
    hooks = HookRegistry()
    q = hooks.bind("q", layout="vec")
    ch = backend.sink(
        SCHEMA,
        flaky,
        raw=["vec"],
        hooks=hooks,
        batching=Batching(max_rows=2_000_000, max_bytes=2**30, inserts_in_flight=1),
        retry=Retry(attempts=2, initial_backoff=0.001),
    )
    n = 1_100_000

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(ch.run)
            await ch.submit(vec_batch(q, n))
            await ch.flush()
            await ch.close()

    trio.run(main)
    assert len(flaky.tokens) == 2 and len(set(flaky.tokens)) == 1
    assert _counts(backend) == [{"n": n, "u": n}]
