"""Latency across load levels, corrected for coordinated omission.

For each route kind, the capacity is measured first (same config, producer
unpaced, clock stopped at ``flush()``), then the producer runs paced at 10 to
95% of it.  Pacing keeps a fixed schedule: batch ``i`` is due at
``t0 + i * interval``; a producer running late submits at once and never
skips a slot.  Latency is measured from the batch's *intended* send time
(the wrk2 / HdrHistogram correction for coordinated omission: a stall delays
every batch scheduled during it, and all of them count); the naive figure,
from the actual ``submit_batch`` call, is reported beside it.  Also recorded:
how long ``submit_batch`` holds the producer thread.

Routes (MiniLM token states, 384 float32, 128 records per batch):

- forward -> a destination copying the records' bytes (receipt time);
- stateless (a small numpy processor) -> the same kind of destination;
- forward -> ClickHouse (chDB) with a 50 ms linger: time until the rows are
  persisted, i.e. the sink's insert for them returned (its per-table row
  counter, polled every millisecond, passes the batch's cumulative count).
"""

from __future__ import annotations

import tempfile
import threading
import time

import numpy as np
from _workload import CopySink, descriptors, layout_for, payloads
from harness import arguments, fmt, target, write_result
from hdrh.histogram import HdrHistogram

from taproute.service import (
    Batching,
    ClickHouseSink,
    Layout,
    Records,
    RecordSchema,
    Route,
    RoutingConfig,
    RoutingSink,
    create_record_runtime,
    stateless_processor,
)

SHAPE = "minilm_token"
PER_BATCH = 128
FLOATS = 384
STAMP = Layout("stamp", [("intended_ns", "Int64"), ("actual_ns", "Int64"), ("norm", "Float32")])
SCHEMA = RecordSchema([layout_for(SHAPE), STAMP])
LINGER = 0.05
MODES = ("forward", "stateless", "clickhouse")


@stateless_processor("bench.latency_norm", input=SHAPE, output="stamp")
def latency_norm(records: Records) -> np.ndarray:
    rows = np.empty(len(records), dtype=STAMP.dtype)
    rows["intended_ns"] = records.descriptors["timestamp_ns"]
    rows["actual_ns"] = records.descriptors["seq"]
    rows["norm"] = np.linalg.norm(records.rows()["values"], axis=1)
    return rows


def _histogram() -> HdrHistogram:
    return HdrHistogram(1, 600_000_000, 3)  # microseconds, up to 10 minutes


class ReceiptSink(CopySink):
    """Copies what it gets, and records each record's latency (µs) from its
    intended and from its actual submit time."""

    def __init__(self) -> None:
        super().__init__()
        self.intended = _histogram()
        self.actual = _histogram()

    async def submit(self, batch: object) -> None:
        await super().submit(batch)
        now = time.perf_counter_ns()
        rows = getattr(batch, "rows", None)
        if rows is not None:
            intended, actual = rows["intended_ns"], rows["actual_ns"]
        else:
            intended, actual = batch.descriptors["timestamp_ns"], batch.descriptors["seq"]  # type: ignore[attr-defined]
        for hist, sent in ((self.intended, intended), (self.actual, actual)):
            values, counts = np.unique((now - sent) // 1000, return_counts=True)
            for value, count in zip(values.tolist(), counts.tolist(), strict=True):
                hist.record_value(max(1, value), count)


class PersistWatch:
    """Polls the ClickHouse sink's row counter every millisecond from a
    thread; afterwards, says when each cumulative row count was reached."""

    def __init__(self, sink: ClickHouseSink, table: str) -> None:
        self.sink, self.table = sink, table
        self.times: list[int] = []
        self.counts: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        last = -1
        counters = self.sink.counters[self.table]
        while not self._stop.wait(0.001):
            n = counters.records
            if n != last:
                self.times.append(time.perf_counter_ns())
                self.counts.append(n)
                last = n

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def reached(self, cumulative: np.ndarray) -> np.ndarray:
        index = np.searchsorted(np.asarray(self.counts), cumulative, side="left")
        return np.asarray(self.times, dtype=np.int64)[index]


def build(mode: str, folder: str) -> tuple[RoutingSink, object]:
    """The routing sink and its destination (for ClickHouse, the sink the
    routing sink creates and owns, reachable once the runtime started)."""
    if mode == "clickhouse":
        made: list[ClickHouseSink] = []

        def factory() -> ClickHouseSink:
            made.append(
                ClickHouseSink.embedded(
                    SCHEMA,
                    folder,
                    raw=[SHAPE],
                    raw_table="lat_{layout}",
                    batching=Batching(linger=LINGER),
                )
            )
            return made[0]

        router = RoutingSink(
            RoutingConfig([Route("r", "*", "d")]), SCHEMA, {"d": factory}, unmatched="drop"
        )
        return router, made
    dest = ReceiptSink()
    route = (
        Route("r", "*", "d")
        if mode == "forward"
        else Route("r", "*", "d", mode="stateless", processor="bench.latency_norm", workers=2)
    )
    router = RoutingSink(RoutingConfig([route]), SCHEMA, {"d": dest}, unmatched="drop")
    return router, dest


def run(mode: str, batches: int, rate: float | None, folder: str) -> dict[str, object]:
    """Submit ``batches`` batches paced at ``rate`` records/s (None: unpaced)."""
    router, dest = build(mode, folder)
    bufs = payloads(SHAPE, PER_BATCH)
    hold = _histogram()
    intended_ns = np.zeros(batches, dtype=np.int64)
    watch = None
    with create_record_runtime(record_sink=router) as runtime:
        h = runtime.bind_hook("layers.0", layout=SHAPE)
        if isinstance(dest, list):  # ClickHouse: the sink the routing sink made
            watch = PersistWatch(dest[0], f"lat_{SHAPE}")
        interval = 0 if rate is None else int(PER_BATCH / rate * 1e9)
        started = time.perf_counter_ns()
        for i in range(batches):
            due = started + i * interval
            if interval:
                ahead = due - time.perf_counter_ns()
                if ahead > 0:
                    time.sleep(ahead / 1e9)
            now = time.perf_counter_ns()
            sent = due if interval else now
            intended_ns[i] = sent
            desc = descriptors(h, SHAPE, PER_BATCH, timestamps_ns=sent)
            desc["seq"] = now
            runtime.submit_batch(desc, bufs[i % len(bufs)])
            hold.record_value(max(1, (time.perf_counter_ns() - now) // 1000))
        runtime.flush()
        elapsed = (time.perf_counter_ns() - started) / 1e9
    out: dict[str, object] = {"achieved_records_per_s": batches * PER_BATCH / elapsed, "hold": hold}
    if watch is not None:
        watch.stop()
        persisted = watch.reached(np.arange(1, batches + 1) * PER_BATCH)
        intended, actual = _histogram(), _histogram()
        for value in ((persisted - intended_ns) // 1000).tolist():
            intended.record_value(max(1, value), PER_BATCH)
        out["intended"], out["actual"] = intended, actual  # actual: not separable here
    else:
        assert isinstance(dest, ReceiptSink)
        assert dest.records == batches * PER_BATCH
        out["intended"], out["actual"] = dest.intended, dest.actual
    return out


def _percentiles(hist: HdrHistogram) -> dict[str, float]:
    if hist.get_total_count() == 0:
        return {}
    return {
        "p50_ms": hist.get_value_at_percentile(50) / 1000,
        "p90_ms": hist.get_value_at_percentile(90) / 1000,
        "p99_ms": hist.get_value_at_percentile(99) / 1000,
        "p99_9_ms": hist.get_value_at_percentile(99.9) / 1000,
        "max_ms": hist.get_max_value() / 1000,
    }


def main() -> None:
    args = arguments(
        __doc__, repeat=(1, 1), seconds=(4.0, 0.8), levels=([10, 25, 50, 80, 90, 95], [25, 80, 95])
    )
    results: dict[str, dict[str, object]] = {}
    curves, rows, targets, notes = [], [], [], []
    with tempfile.TemporaryDirectory() as folder:
        for mode in MODES:
            cap_batches = int((400 if mode == "clickhouse" else 1500) * (0.25 if args.quick else 1))
            # Capacity: the median of three unpaced runs (one is at the mercy of a
            # noisy second on shared cores).
            capacities = [
                float(run(mode, cap_batches, None, folder)["achieved_records_per_s"])
                for _ in range(3)
            ]
            capacity = sorted(capacities)[1]
            per_level: dict[str, object] = {
                "capacity_records_per_s": capacity,
                "capacity_samples": capacities,
            }
            for level in args.levels:
                rate = capacity * level / 100
                batches = max(50, int(rate * args.seconds / PER_BATCH))
                got = run(mode, batches, rate, folder)
                figures = {
                    "offered_records_per_s": rate,
                    "achieved_records_per_s": got["achieved_records_per_s"],
                    "from_intended": _percentiles(got["intended"]),
                    "from_actual_submit": _percentiles(got["actual"]),
                    "submit_hold": _percentiles(got["hold"]),
                }
                per_level[str(level)] = figures
                i, a, hold = (
                    figures["from_intended"],
                    figures["from_actual_submit"],
                    figures["submit_hold"],
                )
                rows.append(
                    [
                        mode,
                        level,
                        rate,
                        figures["achieved_records_per_s"],
                        i["p50_ms"],
                        i["p99_ms"],
                        i["p99_9_ms"],
                        i["max_ms"],
                        a.get("p99_ms", "n/a"),
                        hold["p50_ms"],
                        hold["p99_ms"],
                        hold["max_ms"],
                    ]
                )
            results[mode] = per_level
            levels = [str(level) for level in args.levels]
            curves.append(
                {
                    "title": f"{mode}: latency from intended send time vs load",
                    "x_label": "% of measured capacity",
                    "y_label": "ms",
                    "x": list(args.levels),
                    "series": {
                        f"taproute {mode} p{p}": [
                            per_level[lv]["from_intended"][f"p{p}_ms"] for lv in levels
                        ]
                        for p in ("50", "99", "99_9")
                    },
                    "log_y": True,
                }
            )
    stateless_80 = results["stateless"].get("80")
    if stateless_80:
        p99 = stateless_80["from_intended"]["p99_ms"]
        targets.append(
            target(
                "stateless p99 submit -> destination <= 5 ms at 80% of capacity",
                p99 <= 5,
                f"p99 {p99:.2f} ms",
            )
        )
    for mode in MODES:
        notes.append(
            f"{mode}: capacity {fmt(results[mode]['capacity_records_per_s'])} records/s; "
            + "; ".join(
                f"at {lv}% p99 {results[mode][str(lv)]['from_intended']['p99_ms']:.3g} ms"
                for lv in args.levels
            )
            + "."
        )
    write_result(
        "latency",
        title="Latency vs load (coordinated-omission corrected)",
        description=__doc__.split("\n\n")[0],
        params={
            "shape": SHAPE,
            "records_per_batch": PER_BATCH,
            "levels_pct": args.levels,
            "seconds_per_level": args.seconds,
            "clickhouse_linger_s": LINGER,
            "persist_poll_s": 0.001,
        },
        quick=args.quick,
        curves=curves,
        tables=[
            {
                "title": "Latency by load level (ms; 'intended' = from the scheduled send time)",
                "columns": [
                    "route",
                    "load %",
                    "offered rec/s",
                    "achieved rec/s",
                    "p50",
                    "p99",
                    "p99.9",
                    "max",
                    "naive p99 (from submit)",
                    "submit hold p50",
                    "hold p99",
                    "hold max",
                ],
                "rows": rows,
            }
        ],
        targets=targets,
        notes=notes,
        raw=results,
    )


if __name__ == "__main__":
    main()
