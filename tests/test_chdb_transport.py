"""chDB's transport: inserts on connections of their own (in parallel, never
behind the shared session's lock), each block written once whichever
connection carries it, and the settings tables created on chDB get."""

from __future__ import annotations

import threading
import uuid

import numpy as np
import pyarrow as pa
import pytest
import trio

from taproute.routing import Layout, RecordSchema, RowBatch
from taproute.service import ClickHouseSink
from taproute.service.sinks.clickhouse import ChdbTransport, ServerTransport
from taproute.service.sinks.clickhouse.tables import raw_table_spec
from taproute.service.sinks.clickhouse.transport import CHDB_TABLE_SETTINGS

HANG_GUARD = 60.0  # seconds; only reached when an insert waits for the held lock

VEC = Layout("vec", [("values", "Array(Float32)", (4,))])


def _table(transport: ChdbTransport) -> str:
    name = "t" + uuid.uuid4().hex[:10]
    transport.execute(
        f"CREATE TABLE `{name}` (writer UInt8, block UInt32, v Array(Float32)) "
        "ENGINE = MergeTree ORDER BY (writer, block) "
        "SETTINGS non_replicated_deduplication_window = 1000"
    )
    return name


def _block(writer: int, block: int, rows: int = 20, width: int = 64) -> pa.Table:
    """``rows`` rows whose every value says which writer and block made it."""
    values = np.full(rows * width, writer * 1000 + block, dtype=np.float32)
    offsets = np.arange(0, rows * width + 1, width, dtype=np.int32)
    return pa.table(
        {
            "writer": pa.array(np.full(rows, writer, dtype=np.uint8)),
            "block": pa.array(np.full(rows, block, dtype=np.uint32)),
            "v": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values)),
        }
    )


def test_an_insert_does_not_wait_for_the_shared_session(chdb_transport):
    """A query or DDL holding the directory's shared session (and its lock)
    does not hold up an insert: inserts run on connections of their own."""
    table = _table(chdb_transport)
    done = threading.Event()

    def insert() -> None:
        chdb_transport.insert(table, _block(1, 1), dedup_token=uuid.uuid4().hex)
        done.set()

    with chdb_transport._lock:  # what a query on the shared session holds
        inserter = threading.Thread(target=insert, daemon=True)
        inserter.start()
        finished = done.wait(HANG_GUARD)
    inserter.join(HANG_GUARD)
    assert finished, "the insert waited for the shared session's lock"
    count = chdb_transport.query(f"SELECT count() AS n FROM `{table}`")
    assert count.column("n").to_pylist() == [20]


def test_concurrent_inserts_each_land_once_with_their_own_rows(chdb_transport):
    """Several threads inserting at once (each through ``Python()`` on its own
    Arrow table) write exactly their own rows; a repeat of a block with its
    token, from another thread, writes nothing."""
    table = _table(chdb_transport)
    writers, blocks = 4, 6
    tokens = {(w, b): uuid.uuid4().hex for w in range(writers) for b in range(blocks)}
    errors: list[BaseException] = []
    start = threading.Barrier(writers)

    def writer(w: int) -> None:
        try:
            start.wait(HANG_GUARD)
            for b in range(blocks):
                chdb_transport.insert(table, _block(w, b), dedup_token=tokens[w, b])
            # The retry of another writer's first block: same data, same token.
            other = (w + 1) % writers
            chdb_transport.insert(table, _block(other, 0), dedup_token=tokens[other, 0])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(w,), daemon=True) for w in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(HANG_GUARD)
    assert not errors
    assert not any(thread.is_alive() for thread in threads)
    result = chdb_transport.query(
        f"SELECT writer, block, count() AS n, "
        f"countIf(arrayAll(x -> x = writer * 1000 + block, v)) AS right "
        f"FROM `{table}` GROUP BY writer, block ORDER BY writer, block"
    ).to_pydict()
    expected = [(w, b) for w in range(writers) for b in range(blocks)]
    assert list(zip(result["writer"], result["block"], strict=True)) == expected
    assert result["n"] == [20] * len(expected)
    assert result["right"] == [20] * len(expected)


def test_a_closed_transport_refuses_inserts(chdb_transport):
    """Closing releases every insert connection (and this transport's share of
    the directory); a later insert says so, the other transports go on."""
    transport = ChdbTransport(chdb_transport.path)  # chDB has one directory per process
    try:
        table = _table(transport)
        transport.insert(table, _block(1, 1), dedup_token="a")
    finally:
        transport.close()
    try:
        transport.insert(table, _block(1, 2), dedup_token="b")
    except RuntimeError as exc:
        assert "is closed" in str(exc)
    else:
        raise AssertionError("an insert into a closed transport went through")
    transport.close()  # idempotent
    count = chdb_transport.query(f"SELECT count() AS n FROM `{table}`")
    assert count.column("n").to_pylist() == [20]


def test_tables_created_on_chdb_merge_less_eagerly(chdb_transport):
    schema = RecordSchema([VEC])
    name = "t" + uuid.uuid4().hex[:10] + "_raw_{layout}"
    sink = ClickHouseSink(
        chdb_transport,
        schema,
        raw=["vec"],
        raw_table=name,
        create_tables=True,
        owns_transport=False,
    )
    (table,) = sink.tables
    created = chdb_transport.query(f"SHOW CREATE TABLE `{table}`").column(0)[0].as_py()
    for setting, value in CHDB_TABLE_SETTINGS.items():
        assert f"{setting} = {value}" in created
    assert "non_replicated_deduplication_window = 10000" in created


def test_server_tables_get_only_the_deduplication_window():
    """A server's version (and the settings it knows) is the user's: tables
    created there get nothing beyond the deduplication window."""
    spec = raw_table_spec(VEC, "raw_vec")
    sql = spec.create_sql(ServerTransport.table_settings)
    assert sql.endswith("SETTINGS non_replicated_deduplication_window = 10000")
    assert spec.create_sql() == sql


def _every_type_table(transport: ChdbTransport) -> str:
    name = "t" + uuid.uuid4().hex[:10]
    transport.execute(
        f"CREATE TABLE `{name}` (hook LowCardinality(String), id UInt32, at DateTime64(9), "
        "half BFloat16, halves Array(BFloat16), ok Bool, tag FixedString(3), note String, "
        "wide Float64, shape Array(UInt32)) ENGINE = MergeTree ORDER BY (hook, id) "
        "SETTINGS non_replicated_deduplication_window = 1000"
    )
    return name


def _every_type_block(first: int, names: list[str]) -> pa.Table:
    """Four rows of every column kind the sink writes; ``hook`` encoded with
    the dictionary ``names`` (the sink's hook names when it converted them)."""
    ids = np.arange(first, first + 4, dtype=np.uint32)
    halves = np.array([1.5, -2.25, 3.0e38, 2.0**-130, 7.0, 0.0, -0.0, 1.0], dtype=np.float32)
    return pa.table(
        {
            "hook": pa.DictionaryArray.from_arrays(
                pa.array(np.array([0, 1, 0, len(names) - 1], dtype=np.int32)),
                pa.array(names, pa.string()),
            ),
            "id": pa.array(ids),
            "at": pa.array(ids.astype(np.int64) * 1_000_000_007).cast(pa.timestamp("ns")),
            "half": pa.array(halves[:4]),
            "halves": pa.ListArray.from_arrays(
                pa.array(np.array([0, 2, 2, 5, 8], dtype=np.int32)), pa.array(halves)
            ),
            "ok": pa.array([True, False, True, True]),
            "tag": pa.array([b"abc", b"de\x00", b"\xff\x00z", b"xyz"], pa.binary(3)),
            "note": pa.array(["", "é ü", "x" * 300, "tab\there"], pa.string()),
            "wide": pa.array(np.array([1e300, -1e-300, 0.1, np.pi])),
            "shape": pa.ListArray.from_arrays(
                pa.array(np.array([0, 2, 2, 3, 4], dtype=np.int32)),
                pa.array(np.array([4, 384, 7, 2**32 - 1], dtype=np.uint32)),
            ),
        }
    )


@pytest.fixture
def through_file(chdb_transport):
    """A transport handing blocks over as in-memory Arrow files (Linux)."""
    transport = ChdbTransport(chdb_transport.path, scratch_inserts=True)
    yield transport
    transport.close()


def test_both_ways_into_chdb_write_the_same_values(chdb_transport, through_file):
    """Blocks handed over as an in-memory Arrow file and through ``Python()``
    (the default) land as the same rows, value for value: BFloat16 (given as
    Float32) exactly, nanoseconds, bytes, text, the hook names of a block
    whose batches were converted under two versions of them."""
    assert through_file.scratch_inserts and not chdb_transport.scratch_inserts
    tables = {}
    for name, transport in (("file", through_file), ("python", chdb_transport)):
        table = _every_type_table(transport)
        block = pa.concat_tables(
            [
                _every_type_block(0, ["a.h0", "a.h1"]),
                _every_type_block(4, ["a.h0", "a.h1", "a.h2"]),
            ]
        )
        transport.insert(table, block, dedup_token=uuid.uuid4().hex)
        tables[name] = table
    read = {
        name: chdb_transport.query(
            f"SELECT hook, id, toUnixTimestamp64Nano(at) AS at, "
            f"reinterpretAsUInt16(half) AS half_bits, "
            f"arrayMap(x -> reinterpretAsUInt16(x), halves) AS halves_bits, ok, "
            f"hex(tag) AS tag, note, wide, shape FROM `{table}` ORDER BY id"
        ).to_pydict()
        for name, table in tables.items()
    }
    assert read["file"] == read["python"]
    got = read["file"]
    assert got["hook"] == ["a.h0", "a.h1", "a.h0", "a.h1", "a.h0", "a.h1", "a.h0", "a.h2"]
    assert got["at"][3] == 3 * 1_000_000_007
    assert got["tag"][:3] == ["616263", "646500", "FF007A"]
    assert got["note"][2] == "x" * 300
    assert got["shape"][:4] == [[4, 384], [], [7], [2**32 - 1]]
    # 1.5 and -2.25 are bfloat16 values: their bits are Float32's upper half.
    expected = np.array([1.5, -2.25], dtype=np.float32).view(np.uint32) >> 16
    assert got["half_bits"][:2] == expected.tolist()
    assert got["halves_bits"][0] == expected.tolist()


def test_an_insert_leaves_its_in_memory_file_empty_and_a_refused_block_writes_nothing(
    through_file,
):
    """Between inserts the transport holds no copy of a block; a block chDB
    refuses raises chDB's error naming the column, and the next block goes
    through the same connection and file."""
    chdb_transport = through_file
    table = _table(chdb_transport)
    chdb_transport.insert(table, _block(1, 1), dedup_token=uuid.uuid4().hex)
    bad = _block(1, 2).set_column(2, "v", pa.array([["not a float"]] * 20, pa.list_(pa.string())))
    try:
        chdb_transport.insert(table, bad, dedup_token=uuid.uuid4().hex)
    except Exception as exc:
        assert "`v`" in str(exc)
    else:
        raise AssertionError("a block of text went into Array(Float32)")
    chdb_transport.insert(table, _block(1, 3), dedup_token=uuid.uuid4().hex)
    lanes = chdb_transport._opened
    assert lanes and all(lane.scratch is not None and lane.scratch.size == 0 for lane in lanes)
    count = chdb_transport.query(
        f"SELECT block, count() AS n FROM `{table}` GROUP BY block ORDER BY block"
    ).to_pydict()
    assert count == {"block": [1, 3], "n": [20, 20]}


@pytest.mark.parametrize("scratch_inserts", [False, True], ids=["python", "file"])
def test_fixed_string_values_ending_in_nul_bytes_land_exactly(chdb_transport, scratch_inserts):
    """A FixedString(n) value is n bytes, trailing NULs included (b"ab" is
    "ab\\0\\0").  numpy's tolist() strips them, so the Arrow conversion refused
    the whole block (a value 2 bytes long for binary(4)) and the sink latched
    a failure: now the column is built from the bytes."""
    name = "fixed_" + uuid.uuid4().hex[:8]
    layout = Layout(name, [("id", "UInt8"), ("tag", "FixedString(4)")])
    schema = RecordSchema([layout])
    rows = np.zeros(4, layout.dtype)
    rows["id"] = np.arange(4)
    rows["tag"] = [b"abcd", b"ab", b"", b"\xff\x00z"]
    sink = ClickHouseSink.embedded(
        schema, chdb_transport.path, rows=[name], scratch_inserts=scratch_inserts
    )

    async def write() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(sink.run)
            await sink.submit(RowBatch(route="r", layout_name=name, rows=rows))
            await sink.flush()
            await sink.close()

    trio.run(write)
    got = chdb_transport.query(f"SELECT hex(tag) AS tag FROM `{name}` ORDER BY id").to_pydict()
    assert got["tag"] == ["61626364", "61620000", "00000000", "FF007A00"]


def test_a_failed_scratch_file_check_says_why_and_is_tried_again(chdb_transport, monkeypatch):
    """scratch_inserts=True on a process where the in-memory file check failed
    names the reason; the failure is not remembered (it may have passed: out
    of file descriptors), so a later transport checks again and works."""
    from taproute.routing import ConfigError
    from taproute.service.sinks.clickhouse import scratch

    monkeypatch.setattr(scratch, "_worked", False)

    class Refusing:
        def query(self, *args: object, **kwargs: object) -> object:
            raise OSError(24, "Too many open files")

    why = scratch.scratch_files_work(Refusing())
    assert why is not None and "Too many open files" in why
    real_check = scratch._check
    monkeypatch.setattr(scratch, "_check", lambda session: "chDB could not read it back: EMFILE")
    with pytest.raises(ConfigError, match="scratch_inserts=True.*could not read it back: EMFILE"):
        ChdbTransport(chdb_transport.path, scratch_inserts=True)
    monkeypatch.setattr(scratch, "_check", real_check)
    transport = ChdbTransport(chdb_transport.path, scratch_inserts=True)
    try:
        assert transport.scratch_inserts
    finally:
        transport.close()
