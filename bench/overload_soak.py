"""Overload soak: a producer 10x faster than a deliberately slow destination.

The destination takes ``--delay`` seconds per batch (capacity = batch / delay
records/s); the producer offers 10x that for ``--duration`` seconds, each
batch a freshly allocated buffer.  Checked: RSS growth stays within the
configured capacities (ingress + destination mailbox, in bytes) + 10%; every
record submitted arrives (in = out); the producer's blocked time is reported.
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np
import psutil
import trio
from harness import report, targets_report

from taproute.actors import RoutingSink
from taproute.native import make_descriptors
from taproute.routing import Batch, Layout, RecordSchema, Route, RoutingConfig
from taproute.service import create_record_runtime

RECORD = 1024
PER_BATCH = 256
SCHEMA = RecordSchema([Layout("kib", [("bytes", "Array(UInt8)", (RECORD,))])])
MiB = 2**20


class SlowSink:
    """Takes ``delay`` seconds per batch; counts what it got."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.records = 0

    async def submit(self, batch: Batch) -> None:
        await trio.sleep(self.delay)
        self.records += len(batch)

    async def flush(self) -> None:
        pass

    async def close(self) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--delay", type=float, default=0.002, help="seconds per batch")
    parser.add_argument("--capacity-mib", type=int, default=16, help="ingress and mailbox each")
    args = parser.parse_args()
    capacity_bytes = args.capacity_mib * MiB
    capacity_records = capacity_bytes // RECORD
    sink = SlowSink(args.delay)
    router = RoutingSink(
        RoutingConfig([Route("raw", "*", "slow")]),
        SCHEMA,
        {"slow": sink},
        unmatched="drop",
        destination_capacity=capacity_records,
        destination_capacity_bytes=capacity_bytes,
    )
    destination_rate = PER_BATCH / args.delay
    offered_rate = 10 * destination_rate
    process = psutil.Process()
    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.05):
            peak[0] = max(peak[0], process.memory_info().rss)

    with create_record_runtime(
        record_sink=router, capacity_records=capacity_records, capacity_bytes=capacity_bytes
    ) as runtime:
        h = runtime.bind_hook("layers.0.act", layout="kib")
        desc = make_descriptors(h, RECORD, count=PER_BATCH, layout_ids=0)
        baseline = process.memory_info().rss
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        submitted = 0
        started = time.monotonic()
        while (elapsed := time.monotonic() - started) < args.duration:
            if submitted > offered_rate * elapsed:
                time.sleep(0.0005)
                continue
            runtime.submit_batch(desc, np.full(RECORD * PER_BATCH, submitted % 251, np.uint8))
            submitted += PER_BATCH
        produce_seconds = time.monotonic() - started
        runtime.flush()
        counters = runtime.counters()
    stop.set()
    sampler.join()
    growth = peak[0] - baseline
    bound = 2 * capacity_bytes * 1.1  # ingress + destination mailbox, + 10%
    blocked = counters.ingress.blocked_seconds if counters.ingress else 0.0
    targets = {
        "rss_growth<=capacities+10%": growth <= bound,
        "in==out": sink.records == submitted,
    }
    report(
        "overload_soak",
        {
            "duration_s": args.duration,
            "destination_capacity_records_per_s": destination_rate,
            "offered_records_per_s": offered_rate,
            "peer": "the destination's own capacity (the producer offers 10x)",
            "submitted": submitted,
            "delivered": sink.records,
            "delivered_records_per_s": sink.records / produce_seconds,
            "producer_blocked_s": blocked,
            "producer_blocked_share": blocked / produce_seconds,
            "configured_capacity_bytes": 2 * capacity_bytes,
            "rss_baseline_MiB": baseline / MiB,
            "rss_peak_growth_MiB": growth / MiB,
            "rss_bound_MiB": bound / MiB,
            "targets": targets_report(targets),
        },
    )


if __name__ == "__main__":
    main()
