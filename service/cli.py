"""The ``taproute`` command."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import numpy as np
from taproute.actors import RoutingSink
from taproute.service import synthetic
from taproute.service.capture import CaptureSink
from taproute.service.runtime import create_record_runtime


def demo(requests: int, seed: int) -> int:
    """Route synthetic attention captures through forward, stateless and stateful routes."""
    raw, stats = CaptureSink(), CaptureSink()
    sink = RoutingSink(
        synthetic.demo_routes("raw", "stats"),
        synthetic.SCHEMA,
        {"raw": raw, "stats": stats},
        unmatched="drop",
    )
    rng = np.random.default_rng(seed)
    started = time.perf_counter()
    with create_record_runtime(record_sink=sink) as runtime:
        ids = [
            runtime.bind_hook(f"layers.{i}.attn.q", layout="query") for i in range(synthetic.LAYERS)
        ]
        for request in range(requests):
            descriptors, payload = synthetic.forward_pass(rng, request, ids)
            runtime.submit_batch(descriptors, payload)
        runtime.flush()
        counters = runtime.counters()
    elapsed = time.perf_counter() - started
    records = counters.ingress.submitted if counters.ingress else 0
    print(f"taproute demo: {requests} requests x {synthetic.LAYERS} layers, {elapsed:.2f} s")
    print(f"{'route':<12} {'mode':<10} {'processed':>10} {'emitted':>9} {'failed':>7}")
    for route in counters.routes.values():
        print(
            f"{route.name:<12} {route.mode:<10} {route.processed:>10} {route.emitted:>9} "
            f"{route.failed:>7}"
        )
    blocked = counters.ingress.blocked_seconds if counters.ingress else 0.0
    mb = records * synthetic.QUERY.dtype.itemsize / 2**20
    print(
        f"throughput: {records / elapsed:,.0f} records/s ({mb / elapsed:,.0f} MiB/s), "
        f"producer blocked {blocked:.3f} s"
    )
    latest = {int(row["layer"]): row for row in stats.rows("unit_stats")}  # last one wins
    print("per-layer mean variance of query units (the synthetic scale grows with depth):")
    for layer, row in sorted(latest.items()):
        print(
            f"  layer {layer}: {float(row['variance'].mean()):.3f} over {int(row['count'])} tokens"
        )
    raw.clear()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``taproute`` command."""
    parser = argparse.ArgumentParser(prog="taproute", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser("demo", help="route synthetic model captures end to end")
    demo_parser.add_argument("--requests", type=int, default=500)
    demo_parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo(args.requests, args.seed)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
