"""The ``taproute`` command."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from taproute.actors import RouterSnapshot, RoutingSink
from taproute.service import synthetic
from taproute.service.clickhouse import ChdbTransport, ClickHouseSink
from taproute.service.runtime import create_record_runtime

DEMO_TABLES = ("raw_query", "head_norms", "unit_stats")


def demo(requests: int, seed: int, data: Path) -> int:
    """Route synthetic attention captures into chDB through forward, stateless and
    stateful routes, then query what landed."""
    transport = ChdbTransport(data)
    for table in DEMO_TABLES:  # the demo starts from empty tables
        transport.execute(f"DROP TABLE IF EXISTS `{table}`")
    sink = RoutingSink(
        synthetic.demo_routes("clickhouse", "clickhouse"),
        synthetic.SCHEMA,
        {
            "clickhouse": lambda: ClickHouseSink(
                transport,
                synthetic.SCHEMA,
                raw=["query"],
                rows=["head_norms", "unit_stats"],
                create_tables=True,
                owns_transport=False,
            )
        },
        unmatched="drop",
    )
    rng = np.random.default_rng(seed)
    started = time.perf_counter()
    try:
        with create_record_runtime(record_sink=sink) as runtime:
            ids = [
                runtime.bind_hook(f"layers.{i}.attn.q", layout="query")
                for i in range(synthetic.LAYERS)
            ]
            for request in range(requests):
                descriptors, payload = synthetic.forward_pass(rng, request, ids)
                runtime.submit_batch(descriptors, payload)
            runtime.flush()
            counters = runtime.counters()
        elapsed = time.perf_counter() - started
        _print_summary(requests, elapsed, counters, transport)
    finally:
        transport.close()
    return 0


def _print_summary(
    requests: int, elapsed: float, counters: RouterSnapshot, transport: ChdbTransport
) -> None:
    ingress = counters.ingress
    records = ingress.submitted if ingress else 0
    print(f"taproute demo: {requests} requests x {synthetic.LAYERS} layers in {elapsed:.2f} s")
    print(f"{'route':<12} {'mode':<10} {'processed':>10} {'emitted':>9} {'failed':>7}")
    for route in counters.routes.values():
        print(
            f"{route.name:<12} {route.mode:<10} {route.processed:>10} {route.emitted:>9} "
            f"{route.failed:>7}"
        )
    print(f"{'table':<12} {'rows':>10}")
    for table in DEMO_TABLES:
        rows = transport.query(f"SELECT count() AS n FROM `{table}`").column("n")[0].as_py()
        print(f"{table:<12} {rows:>10}")
    blocked = ingress.blocked_seconds if ingress else 0.0
    mib = records * synthetic.QUERY.dtype.itemsize / 2**20
    print(
        f"throughput: {records / elapsed:,.0f} records/s ({mib / elapsed:,.0f} MiB/s), "
        f"producer blocked {blocked:.3f} s"
    )
    sql = (
        "SELECT hook, count() AS captures, round(avg(arrayAvg(values)), 4) AS mean, "
        "round(avg(arrayReduce('varPop', values)), 3) AS variance "
        "FROM raw_query GROUP BY hook ORDER BY hook"
    )
    print(f"\n{sql}")
    result = transport.query(sql)
    print(f"{'hook':<18} {'captures':>9} {'mean':>8} {'variance':>9}")
    for row in result.to_pylist():
        print(f"{row['hook']:<18} {row['captures']:>9} {row['mean']:>8} {row['variance']:>9}")
    print(
        f"\nData: {transport.path} (chDB). Query it with\n"
        f"  python -c \"import chdb.session as s; print(s.Session('{transport.path}')"
        ".query('SELECT layer, max(count) FROM unit_stats GROUP BY layer'))\""
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``taproute`` command."""
    parser = argparse.ArgumentParser(prog="taproute", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser(
        "demo", help="route synthetic model captures into chDB and query them"
    )
    demo_parser.add_argument("--requests", type=int, default=500)
    demo_parser.add_argument("--seed", type=int, default=0)
    demo_parser.add_argument("--data", type=Path, default=Path("taproute-data"))
    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo(args.requests, args.seed, args.data)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
