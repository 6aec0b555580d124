"""Latency from submit to destination receipt, at 50% of measured capacity.

For a forward route and a stateless route (a small numpy processor), the
producer stamps each batch with ``perf_counter_ns`` at submit; the
destination records the receipt time; every record's latency goes into an
HDR histogram.  The capacity is measured first (same config, producer
unpaced), then the producer is paced at half of it, batches evenly spaced (a
producer running late does not catch up in a burst).  The destination is a
null sink, so no destination batching delay is included (ClickHouse's
linger would add up to its ``linger`` setting).  Target (issue #6):
p99 <= 2 ms for both routes.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from harness import profile_threads, report, targets_report
from hdrh.histogram import HdrHistogram

from taproute.actors import RoutingSink
from taproute.native import make_descriptors
from taproute.routing import (
    Batch,
    Layout,
    RecordBatch,
    Records,
    RecordSchema,
    Route,
    RoutingConfig,
    stateless_processor,
)
from taproute.service import create_record_runtime

RECORD = 256
PER_BATCH = 256
ACT = Layout("act", [("values", "Array(Float32)", (RECORD // 4,))])
STAMP = Layout("stamp", [("sent_ns", "Int64"), ("norm", "Float32")])
SCHEMA = RecordSchema([ACT, STAMP])


@stateless_processor("bench.stamp_norm", input="act", output="stamp")
def stamp_norm(records: Records) -> np.ndarray:
    rows = np.empty(len(records), dtype=STAMP.dtype)
    rows["sent_ns"] = records.descriptors["timestamp_ns"]
    rows["norm"] = np.linalg.norm(records.rows()["values"], axis=1)
    return rows


class ReceiptSink:
    """Records each record's latency (receipt - submit stamp) in microseconds."""

    def __init__(self) -> None:
        self.histogram = HdrHistogram(1, 60_000_000, 3)
        self.records = 0

    async def submit(self, batch: Batch) -> None:
        now = time.perf_counter_ns()
        sent = (
            batch.descriptors["timestamp_ns"]
            if isinstance(batch, RecordBatch)
            else (batch.rows["sent_ns"])
        )
        for value, count in zip(*np.unique((now - sent) // 1000, return_counts=True), strict=True):
            self.histogram.record_value(max(1, int(value)), int(count))
        self.records += len(batch)

    async def flush(self) -> None:
        pass

    async def close(self) -> None:
        pass


def run(mode: str, batches: int, rate: float | None) -> tuple[float, ReceiptSink]:
    """Submit ``batches`` batches (paced at ``rate`` records/s, or as fast as it goes)."""
    sink = ReceiptSink()
    route = (
        Route("r", "*", "d")
        if mode == "forward"
        else Route("r", "*", "d", mode="stateless", processor="bench.stamp_norm", workers=2)
    )
    router = RoutingSink(RoutingConfig([route]), SCHEMA, {"d": sink}, unmatched="drop")
    payload = np.random.default_rng(0).standard_normal(PER_BATCH * RECORD // 4, dtype=np.float32)
    with create_record_runtime(record_sink=router) as runtime:
        h = runtime.bind_hook("layers.0.act", layout="act")
        interval = None if rate is None else PER_BATCH / rate
        started = time.perf_counter()
        due = started
        for _ in range(batches):
            if interval is not None:
                # Evenly spaced; a late producer does not catch up in a burst
                # (a burst would measure the load generator, not the router).
                now = time.perf_counter()
                if due > now:
                    time.sleep(due - now)
                due = max(due, now) + interval
            desc = make_descriptors(
                h, RECORD, count=PER_BATCH, layout_ids=0, timestamps_ns=time.perf_counter_ns()
            )
            runtime.submit_batch(desc, payload)
        runtime.flush()
        elapsed = time.perf_counter() - started
    assert sink.records == batches * PER_BATCH
    return batches * PER_BATCH / elapsed, sink


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=10.0, help="paced run per route")
    args = parser.parse_args()
    figures: dict[str, object] = {
        "record_bytes": RECORD,
        "records_per_batch": PER_BATCH,
        "peer": "the same route's own capacity (paced at 50% of it)",
        "note": "null destination: destination batching delay excluded",
    }
    targets = {}
    for mode in ("forward", "stateless"):
        capacity, _ = run(mode, 2000, None)
        rate = capacity / 2
        batches = max(200, int(rate * args.seconds / PER_BATCH))
        achieved, sink = run(mode, batches, rate)
        hist = sink.histogram
        percentiles = {
            "p50_us": hist.get_value_at_percentile(50),
            "p99_us": hist.get_value_at_percentile(99),
            "p99_9_us": hist.get_value_at_percentile(99.9),
            "max_us": hist.get_max_value(),
        }
        figures[mode] = {
            "capacity_records_per_s": capacity,
            "paced_records_per_s": achieved,
            **percentiles,
        }
        targets[f"{mode}_p99<=2ms"] = percentiles["p99_us"] <= 2000
        if percentiles["p99_us"] > 2000:
            figures[f"{mode}_profile"] = profile_threads(
                lambda m=mode, b=batches, r=rate: run(m, b, r)
            )
    figures["targets"] = targets_report(targets)
    report("latency", figures)


if __name__ == "__main__":
    main()
