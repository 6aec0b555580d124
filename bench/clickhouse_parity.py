"""ClickHouse parity: routed vs direct sink vs a bare INSERT, same data, same run.

- routed: a raw-only route through RoutingSink into ClickHouseSink;
- direct: the same ClickHouseSink straight under create_record_runtime;
- bare: the transport's own insert of the same rows, already converted to
  Arrow and cut in blocks of the sink's insert size (chDB: ``INSERT ...
  SELECT FROM Python(arrow)``; a server: clickhouse-connect ``insert_arrow``):
  the engine's own cost, the ceiling for the other two.

On chDB in a temporary directory by default; ``--url http://host:8123/db``
runs the same comparison against a ClickHouse server (credentials as
``ClickHouseSink.server`` takes them; tables ``taproute_parity_*`` are
dropped and re-created there), result kept as ``clickhouse_parity_server``.

Targets (issue #3): routed >= 0.9x direct; direct >= 0.8x bare.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from importlib import metadata

import numpy as np
import pyarrow as pa
from harness import measure, report

from taproute.actors import RoutingSink
from taproute.native import make_descriptors
from taproute.routing import (
    HookRegistry,
    Layout,
    RecordBatch,
    RecordSchema,
    Route,
    RoutingConfig,
)
from taproute.service import create_record_runtime
from taproute.service.sinks.clickhouse import (
    Batching,
    ChdbTransport,
    ClickHouseSink,
    ServerTransport,
    Transport,
)
from taproute.service.sinks.clickhouse.columns import raw_table
from taproute.service.sinks.clickhouse.tables import raw_table_spec

FLOATS = 256  # 1 KiB payload per record
PER_BATCH = 1024
SCHEMA = RecordSchema([Layout("act", [("values", "Array(Float32)", (FLOATS,))])])


def make_data(batches: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(batches):
        payload = rng.standard_normal((PER_BATCH, FLOATS), dtype=np.float32)
        desc = make_descriptors(
            i % 4,
            FLOATS * 4,
            count=PER_BATCH,
            layout_ids=0,
            keys=np.arange(PER_BATCH),
            seqs=np.arange(i * PER_BATCH, (i + 1) * PER_BATCH),
        )
        out.append((desc, payload))
    return out


def run_sink(transport: Transport, data, table: str, routed: bool) -> float:
    transport.execute(f"DROP TABLE IF EXISTS `{table}`")
    sink = lambda: ClickHouseSink(  # noqa: E731
        transport,
        SCHEMA,
        raw=["act"],
        raw_table=table,
        create_tables=True,
        owns_transport=False,
    )
    record_sink = (
        RoutingSink(
            RoutingConfig([Route("raw", "*", "ch")]), SCHEMA, {"ch": sink}, unmatched="drop"
        )
        if routed
        else sink()
    )
    rows = len(data) * PER_BATCH
    with create_record_runtime(record_sink=record_sink) as runtime:
        for i in range(4):
            runtime.bind_hook(f"layers.{i}.act", layout="act")
        started = time.perf_counter()
        for desc, payload in data:
            runtime.submit_batch(desc, payload)
        runtime.flush()
        elapsed = time.perf_counter() - started
    got = transport.query(f"SELECT count() AS n FROM `{table}`").column("n")[0].as_py()
    assert got == rows, (got, rows)
    return rows / elapsed


def run_bare(transport: Transport, data, table: str) -> float:
    transport.execute(f"DROP TABLE IF EXISTS `{table}`")
    spec = raw_table_spec(SCHEMA.layout("act"), table)
    transport.execute(spec.create_sql())
    hooks = HookRegistry()
    for i in range(4):
        hooks.bind(f"layers.{i}.act")
    tables = [
        raw_table(RecordBatch.from_buffer(d, p), SCHEMA.layout("act"), spec, hooks.names())
        for d, p in data
    ]
    # Blocks of the same size the sink inserts (Batching.max_bytes), so the
    # engine does the same amount of work per insert in both.
    per_block = max(1, Batching().max_bytes // (PER_BATCH * FLOATS * 4))
    blocks = [pa.concat_tables(tables[i : i + per_block]) for i in range(0, len(tables), per_block)]
    started = time.perf_counter()
    for i, arrow in enumerate(blocks):
        transport.insert(table, arrow, dedup_token=f"bare-{time.time_ns()}-{i}")
    elapsed = time.perf_counter() - started
    return len(data) * PER_BATCH / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--url", help="a ClickHouse server instead of chDB")
    args = parser.parse_args()
    data = make_data(args.batches)
    with tempfile.TemporaryDirectory() as tmp:
        transport: Transport = ServerTransport(args.url) if args.url else ChdbTransport(tmp)
        engine = transport.description
        if args.url:
            version = transport.query("SELECT version() AS v").column("v")[0].as_py()
            engine = f"{engine} (ClickHouse {version})"
        tables = {k: f"taproute_parity_{k}" for k in ("routed", "direct", "bare")}
        try:
            routed = measure(
                lambda: run_sink(transport, data, tables["routed"], True), repeat=args.repeat
            )
            direct = measure(
                lambda: run_sink(transport, data, tables["direct"], False), repeat=args.repeat
            )
            bare = measure(lambda: run_bare(transport, data, tables["bare"]), repeat=args.repeat)
            if args.url:
                for table in tables.values():
                    transport.execute(f"DROP TABLE IF EXISTS `{table}`")
        finally:
            transport.close()
    mb_per_row = FLOATS * 4 / 1e6
    ratios = {
        "routed_vs_direct": routed["median"] / direct["median"],
        "direct_vs_bare": direct["median"] / bare["median"],
    }
    report(
        "clickhouse_parity_server" if args.url else "clickhouse_parity",
        {
            "engine": "chDB" if not args.url else engine,
            "parameters": {"batches": args.batches, "repeat": args.repeat},
            "versions": {p: metadata.version(p) for p in ("chdb", "clickhouse-connect")},
            "rows_per_run": args.batches * PER_BATCH,
            "payload_bytes_per_row": FLOATS * 4,
            "peer": "bare INSERT of the same Arrow columns through the same transport",
            "routed_rows_per_s": routed,
            "direct_rows_per_s": direct,
            "bare_rows_per_s": bare,
            "routed_MB_per_s": routed["median"] * mb_per_row,
            "direct_MB_per_s": direct["median"] * mb_per_row,
            "bare_MB_per_s": bare["median"] * mb_per_row,
            "ratios": ratios,
            "targets_met": {
                "routed_vs_direct>=0.9": ratios["routed_vs_direct"] >= 0.9,
                "direct_vs_bare>=0.8": ratios["direct_vs_bare"] >= 0.8,
            },
        },
    )


if __name__ == "__main__":
    main()
