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

import tempfile
import time

import numpy as np
import pyarrow as pa
from harness import arguments, comparison, fmt, interleave, target, write_result

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
    # SYNC: the last round's parts are gone before the clock starts (an
    # Atomic database drops them later, in the middle of another variant's run).
    transport.execute(f"DROP TABLE IF EXISTS `{table}` SYNC")
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
    # SYNC: the last round's parts are gone before the clock starts (an
    # Atomic database drops them later, in the middle of another variant's run).
    transport.execute(f"DROP TABLE IF EXISTS `{table}` SYNC")
    spec = raw_table_spec(SCHEMA.layout("act"), table)
    transport.execute(spec.create_sql(transport.table_settings))  # as the sink creates it
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
    # Nine interleaved repetitions even under a suite's --max-repeat: a round
    # takes about a second, and the median of two was one noisy run from the
    # other side of the routed/direct line (a miss in the suite at 57cd9f2,
    # met by five rounds right after: bench/profiles/clickhouse_parity_ab_57cd9f2.txt).
    args = arguments(__doc__, min_repeat=9, repeat=(9, 2), batches=(64, 16), url=(None, None))
    data = make_data(args.batches)
    with tempfile.TemporaryDirectory() as tmp:
        transport: Transport = ServerTransport(args.url) if args.url else ChdbTransport(tmp)
        engine = transport.description
        if args.url:
            version = transport.query("SELECT version() AS v").column("v")[0].as_py()
            engine = f"{engine} (ClickHouse {version})"
        tables = {k: f"taproute_parity_{k}" for k in ("routed", "direct", "bare")}
        try:
            # Interleaved: run in blocks, these three differ by the noise of the minute.
            got = interleave(
                {
                    "routed": lambda: run_sink(transport, data, tables["routed"], True),
                    "direct": lambda: run_sink(transport, data, tables["direct"], False),
                    "bare": lambda: run_bare(transport, data, tables["bare"]),
                },
                repeat=args.repeat,
            )
            if args.url:
                for table in tables.values():
                    transport.execute(f"DROP TABLE IF EXISTS `{table}`")
        finally:
            transport.close()
    routed, direct, bare = got["routed"], got["direct"], got["bare"]
    mb_per_row = FLOATS * 4 / 1e6
    what = (
        f"{PER_BATCH} rows/batch of {FLOATS} float32 into {'a server' if args.url else 'chDB'}, "
        "clock stopped at rows counted"
    )
    routed_label = "routed (RoutingSink -> ClickHouseSink)"
    bare_label = "bare INSERT of ready Arrow blocks"
    comparisons = [
        comparison(
            what,
            routed,
            direct,
            taproute_label=routed_label,
            peer_label="direct ClickHouseSink",
            unit="rows/s",
        ),
        comparison(
            what,
            direct,
            bare,
            taproute_label="direct ClickHouseSink",
            peer_label=bare_label,
            unit="rows/s",
        ),
        comparison(
            what, routed, bare, taproute_label=routed_label, peer_label=bare_label, unit="rows/s"
        ),
    ]
    r_rd = routed["median"] / direct["median"]
    r_db = direct["median"] / bare["median"]
    write_result(
        "clickhouse_parity_server" if args.url else "clickhouse_parity",
        title="ClickHouse: routed vs direct sink vs a bare INSERT"
        + (" (server)" if args.url else " (chDB)"),
        description=__doc__.split("\n\n")[0],
        params={
            "engine": engine if args.url else "chDB",
            "batches": args.batches,
            "rows_per_run": args.batches * PER_BATCH,
            "payload_bytes_per_row": FLOATS * 4,
            "repeat": args.repeat,
        },
        quick=args.quick,
        comparisons=comparisons,
        tables=[
            {
                "title": "Rows/s and MB/s (medians)",
                "columns": ["variant", "rows/s", "MB/s", "spread"],
                "rows": [
                    [name, s["median"], s["median"] * mb_per_row, s["spread"]]
                    for name, s in got.items()
                ],
            }
        ],
        targets=[
            target("routed >= 0.9x direct", r_rd >= 0.9, f"{r_rd:.2f}x"),
            target("direct >= 0.8x bare", r_db >= 0.8, f"{r_db:.2f}x"),
        ],
        notes=[
            f"routed {fmt(routed['median'])} rows/s, direct {fmt(direct['median'])}, bare "
            f"{fmt(bare['median'])} (spreads {routed['spread']:.0%}, {direct['spread']:.0%}, "
            f"{bare['spread']:.0%})."
        ],
        raw=got,
    )


if __name__ == "__main__":
    main()
