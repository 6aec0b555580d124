"""Latency across load levels, corrected for coordinated omission.

For each route kind, each system's capacity is measured first, the same way
for taproute and the peer: the *sustained* rate, i.e. the highest paced rate
it keeps up with (see :func:`sustained_capacity`), starting from its burst
capacity (producer unpaced, clock stopped at ``flush()``: a closed loop's
maximum, which a system that batches whatever queued while it was busy
reaches only under a backlog; paced, each batch comes alone and pays a
wake-up).  Then the producer runs paced at 10 to 95% of the sustained rate.
Pacing keeps a fixed schedule: batch ``i`` is due at
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

The peer, for forward and stateless: the same paced producer feeding a
consumer thread through a bounded ``queue.Queue`` of batches; the consumer
runs the same numpy function and copies the same bytes, and stamps receipt
the same way.  It has its own capacity, measured the same way, and runs at
the same percentages of it, interleaved with taproute level by level, so that a
shared machine's noise (which alone can put a p99 far above 5 ms) shows in
both.
"""

from __future__ import annotations

import gc
import queue
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from _workload import Copier, CopySink, descriptors, layout_for, payloads
from harness import (
    arguments,
    comparison,
    fmt,
    set_switch_interval,
    summary,
    target,
    write_result,
)
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


def stamp_norms(desc: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The stateless work, for taproute's processor and the peer alike."""
    rows = np.empty(len(desc), dtype=STAMP.dtype)
    rows["intended_ns"] = desc["timestamp_ns"]
    rows["actual_ns"] = desc["seq"]
    rows["norm"] = np.linalg.norm(values, axis=1)
    return rows


@stateless_processor("bench.latency_norm", input=SHAPE, output="stamp")
def latency_norm(records: Records) -> np.ndarray:
    return stamp_norms(records.descriptors, records.rows()["values"])


def _histogram() -> HdrHistogram:
    return HdrHistogram(1, 600_000_000, 3)  # microseconds, up to 10 minutes


class Receipts:
    """Each record's latency (µs) from its intended and its actual submit time."""

    def __init__(self) -> None:
        self.intended = _histogram()
        self.actual = _histogram()

    def note(self, intended: np.ndarray, actual: np.ndarray) -> None:
        now = time.perf_counter_ns()
        for hist, sent in ((self.intended, intended), (self.actual, actual)):
            values, counts = np.unique((now - sent) // 1000, return_counts=True)
            for value, count in zip(values.tolist(), counts.tolist(), strict=True):
                hist.record_value(max(1, value), count)


class ReceiptSink(CopySink):
    """Copies what it gets, and stamps receipt."""

    def __init__(self) -> None:
        super().__init__()
        self.receipts = Receipts()

    async def submit(self, batch: object) -> None:
        await super().submit(batch)
        rows = getattr(batch, "rows", None)
        if rows is not None:
            self.receipts.note(rows["intended_ns"], rows["actual_ns"])
        else:
            desc = batch.descriptors  # type: ignore[attr-defined]
            self.receipts.note(desc["timestamp_ns"], desc["seq"])


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


def pace(
    batches: int,
    rate: float | None,
    output_id: int,
    submit: Callable[[np.ndarray, np.ndarray], None],
) -> tuple[np.ndarray, HdrHistogram, int]:
    """Submit ``batches`` batches paced at ``rate`` records/s (None: unpaced)
    on a fixed schedule: batch ``i`` is due at ``t0 + i * interval``; a late
    producer submits at once and never skips a slot.  Each batch's
    descriptors carry its due time (``timestamp_ns``) and its actual submit
    time (``seq``).  Returns the due times, the submit hold times (µs) and t0."""
    bufs = payloads(SHAPE, PER_BATCH)
    hold = _histogram()
    # Collect before the clock starts, for taproute and the peer alike: the
    # garbage of building the last runs (a runtime per run, the results) is
    # the bench's, and a full collection it triggers lands in whichever run
    # comes next (20 ms here, with 68 k objects tracked: at 80% load, one
    # such pause put a run's p99 at 30 ms; bench/_latency_profile.py
    # timeline).  Collections the run's own allocations trigger still count.
    gc.collect()
    intended_ns = np.zeros(batches, dtype=np.int64)
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
        desc = descriptors(output_id, SHAPE, PER_BATCH, timestamps_ns=sent)
        desc["seq"] = now
        submit(desc, bufs[i % len(bufs)])
        hold.record_value(max(1, (time.perf_counter_ns() - now) // 1000))
    return intended_ns, hold, started


def run_peer(mode: str, batches: int, rate: float | None) -> dict[str, object]:
    """The peer: the same paced producer, a consumer thread fed a bounded
    ``queue.Queue`` of batches doing the same work; clock stopped when the
    consumer has handled the last batch."""
    q: queue.Queue[tuple[np.ndarray, np.ndarray] | None] = queue.Queue(maxsize=64)
    copier = Copier()
    receipts = Receipts()

    def consume() -> None:
        while (item := q.get()) is not None:
            desc, payload = item
            if mode == "stateless":
                rows = stamp_norms(desc, payload.reshape(len(desc), FLOATS))
                copier.records += len(rows)
                copier.scratch = rows.copy()
                receipts.note(rows["intended_ns"], rows["actual_ns"])
            else:
                copier(desc, payload)
                receipts.note(desc["timestamp_ns"], desc["seq"])

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    _, hold, started = pace(batches, rate, 0, lambda desc, payload: q.put((desc, payload)))
    q.put(None)
    thread.join()
    elapsed = (time.perf_counter_ns() - started) / 1e9
    assert copier.records == batches * PER_BATCH
    return {
        "achieved_records_per_s": batches * PER_BATCH / elapsed,
        "hold": hold,
        "intended": receipts.intended,
        "actual": receipts.actual,
    }


def run(mode: str, batches: int, rate: float | None, folder: str) -> dict[str, object]:
    """Submit ``batches`` batches paced at ``rate`` records/s (None: unpaced)."""
    router, dest = build(mode, folder)
    watch = None
    with create_record_runtime(record_sink=router) as runtime:
        h = runtime.bind_hook("layers.0", layout=SHAPE)
        if isinstance(dest, list):  # ClickHouse: the sink the routing sink made
            watch = PersistWatch(dest[0], f"lat_{SHAPE}")
        intended_ns, hold, started = pace(batches, rate, h, runtime.submit_batch)
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
        out["intended"], out["actual"] = dest.receipts.intended, dest.receipts.actual
    return out


#: A paced run keeps up when it achieves at least this share of the offered rate.
KEEPS_UP = 0.99
#: Each step of the sustained-capacity search offers this share of the last.
STEP_DOWN = 0.9
#: The search stops here (a share of the burst capacity) whatever happened.
FLOOR = 0.3


def sustained_capacity(
    runners: dict[str, Callable[[int, float | None], dict[str, Any]]],
    burst: dict[str, float],
    seconds: float,
) -> dict[str, dict[str, Any]]:
    """Each system's sustained capacity: the highest paced rate it keeps up with.

    Starting at its burst (unpaced) capacity, each system runs paced for
    ``seconds``; a run that achieves at least :data:`KEEPS_UP` of the
    offered rate settles it at that rate, otherwise the next run offers
    :data:`STEP_DOWN` of it (down to :data:`FLOOR` of the burst capacity,
    where it settles whatever happened).  The same rule for every system;
    the systems still searching take turns at each step, so a noisy moment
    of the machine falls on both.  Returns, per system, the rate and the
    steps tried (offered, achieved).
    """
    found: dict[str, dict[str, Any]] = {name: {"steps": []} for name in runners}
    share = 1.0
    while any("records_per_s" not in f for f in found.values()):
        for name, fn in runners.items():
            if "records_per_s" in found[name]:
                continue
            rate = burst[name] * share
            batches = max(50, int(rate * seconds / PER_BATCH))
            achieved = float(fn(batches, rate)["achieved_records_per_s"])
            found[name]["steps"].append([rate, achieved])
            if achieved >= KEEPS_UP * rate or share * STEP_DOWN < FLOOR:
                found[name]["records_per_s"] = rate
        share *= STEP_DOWN
    return found


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


TARGET_LEVEL = 80
#: A full run measures the target level at least this many times: its p99
#: is the median over them, and one 2.5 s run in four on the quiet machine
#: carried an episode of tens of milliseconds (``_latency_profile.py
#: timeline``), so a median of two (a suite's ``--max-repeat 2``) was one bad
#: run from either side.  Five add well under a minute to a full run.
TARGET_MIN_RUNS = 5


def _row(mode: str, system: str, level: int, figures: dict[str, Any]) -> list[object]:
    i, a, hold = figures["from_intended"], figures["from_actual_submit"], figures["submit_hold"]
    return [
        mode,
        system,
        level,
        figures["offered_records_per_s"],
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


def main() -> None:
    args = arguments(
        __doc__,
        min_repeat=TARGET_MIN_RUNS,  # the runs at the target level
        repeat=(TARGET_MIN_RUNS, 2),
        seconds=(2.5, 0.8),
        levels=([10, 25, 50, 80, 90, 95], [25, 80, 95]),
        capacity_seconds=(1.0, 0.5),
        switch_interval_ms=(0.0, 0.0),
    )
    args.switch_interval_ms = set_switch_interval(args.switch_interval_ms)
    results: dict[str, dict[str, dict[str, Any]]] = {}
    curves: list[dict[str, Any]] = []
    rows: list[list[object]] = []
    targets: list[dict[str, Any]] = []
    notes: list[str] = []
    comparisons: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        for mode in MODES:
            runners: dict[str, Callable[[int, float | None], dict[str, Any]]] = {
                "taproute": lambda b, r, mode=mode: run(mode, b, r, folder)
            }
            if mode != "clickhouse":
                runners["peer"] = lambda b, r, mode=mode: run_peer(mode, b, r)
            cap_batches = int((400 if mode == "clickhouse" else 1500) * (0.25 if args.quick else 1))
            for fn in runners.values():
                fn(max(50, cap_batches // 8), None)  # warm-up: first-run costs out of the figures
            # Burst capacity: the median of three unpaced runs per system,
            # alternating (one is at the mercy of a noisy second on shared cores).
            capacities: dict[str, list[float]] = {name: [] for name in runners}
            for _ in range(3):
                for name, fn in runners.items():
                    capacities[name].append(float(fn(cap_batches, None)["achieved_records_per_s"]))
            burst = {name: sorted(samples)[1] for name, samples in capacities.items()}
            sustained = sustained_capacity(runners, burst, args.capacity_seconds)
            per_system: dict[str, dict[str, Any]] = {
                name: {
                    "capacity_records_per_s": sustained[name]["records_per_s"],
                    "capacity_search": sustained[name]["steps"],
                    "burst_capacity_records_per_s": burst[name],
                    "burst_capacity_samples": samples,
                }
                for name, samples in capacities.items()
            }
            # Levels in turn; at each, the systems alternate which goes first.  The
            # target level is repeated (its p99 is the figure the target is about).
            p99_at_target: dict[str, list[float]] = {name: [] for name in runners}
            for index, level in enumerate(args.levels):
                rounds = args.repeat if level == TARGET_LEVEL else 1
                for round_ in range(rounds):
                    order = list(runners)
                    if (index + round_) % 2:
                        order.reverse()
                    for name in order:
                        capacity = per_system[name]["capacity_records_per_s"]
                        rate = capacity * level / 100
                        batches = max(50, int(rate * args.seconds / PER_BATCH))
                        got = runners[name](batches, rate)
                        figures = {
                            "offered_records_per_s": rate,
                            "achieved_records_per_s": got["achieved_records_per_s"],
                            "from_intended": _percentiles(got["intended"]),
                            "from_actual_submit": _percentiles(got["actual"]),
                            "submit_hold": _percentiles(got["hold"]),
                        }
                        if level == TARGET_LEVEL:
                            p99_at_target[name].append(figures["from_intended"]["p99_ms"])
                        if round_ == 0:
                            per_system[name][str(level)] = figures
                        else:
                            per_system[name][f"{level}.{round_ + 1}"] = figures
                        rows.append(_row(mode, name, level, figures))
            for name in runners:
                per_system[name]["p99_ms_at_target_level"] = p99_at_target[name]
            results[mode] = per_system
            levels = [str(level) for level in args.levels]
            series = {
                f"taproute p{p}": [
                    per_system["taproute"][lv]["from_intended"][f"p{p}_ms"] for lv in levels
                ]
                for p in ("50", "99", "99_9")
            }
            if "peer" in runners:
                series["peer (thread + queue.Queue) p99"] = [
                    per_system["peer"][lv]["from_intended"]["p99_ms"] for lv in levels
                ]
                comparisons.append(
                    comparison(
                        f"{mode}: p99 submit -> destination at {TARGET_LEVEL}% of each "
                        "one's sustained capacity",
                        summary(p99_at_target["taproute"]),
                        summary(p99_at_target["peer"]),
                        taproute_label=f"taproute {mode} route",
                        peer_label="thread + queue.Queue of batches",
                        unit="ms (lower is better)",
                        higher_is_better=False,
                    )
                )
            curves.append(
                {
                    "title": f"{mode}: latency from intended send time vs load",
                    "x_label": "% of sustained capacity",
                    "y_label": "ms",
                    "x": list(args.levels),
                    "series": series,
                    "log_y": True,
                }
            )
            for name in runners:
                got_levels = per_system[name]
                notes.append(
                    f"{mode}, {name}: sustained capacity "
                    f"{fmt(got_levels['capacity_records_per_s'])} records/s "
                    f"(burst {fmt(got_levels['burst_capacity_records_per_s'])}, "
                    f"{len(got_levels['capacity_search'])} paced step(s)); "
                    + "; ".join(
                        f"at {lv}% p99 {got_levels[str(lv)]['from_intended']['p99_ms']:.3g} ms"
                        for lv in args.levels
                    )
                    + "."
                )
    if TARGET_LEVEL in args.levels:
        stateless = results["stateless"]["taproute"]
        ours = statistics.median(stateless["p99_ms_at_target_level"])
        peer = statistics.median(results["stateless"]["peer"]["p99_ms_at_target_level"])
        targets.append(
            target(
                f"stateless p99 submit -> destination <= 5 ms at {TARGET_LEVEL}% of capacity",
                ours <= 5,
                f"p99 {ours:.2f} ms (median of {args.repeat}) at "
                f"{fmt(stateless['capacity_records_per_s'] * TARGET_LEVEL / 100)}"
                f" records/s ({TARGET_LEVEL}% of the sustained capacity, "
                f"{fmt(stateless['capacity_records_per_s'])}; burst "
                f"{fmt(stateless['burst_capacity_records_per_s'])}); "
                f"the peer's {peer:.2f} ms",
            )
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
            "repeat_at_target_level": args.repeat,
            "target_level_pct": TARGET_LEVEL,
            "peer_queue_batches": 64,
            "clickhouse_linger_s": LINGER,
            "persist_poll_s": 0.001,
            "capacity": "sustained: the highest paced rate achieved to within "
            f"{KEEPS_UP:.0%} of the offered, stepping down by {1 - STEP_DOWN:.0%} "
            "from the burst (unpaced) capacity",
            "capacity_seconds_per_step": args.capacity_seconds,
            "switch_interval_ms": args.switch_interval_ms,
        },
        quick=args.quick,
        comparisons=comparisons,
        curves=curves,
        tables=[
            {
                "title": "Latency by load level (ms; 'intended' = from the scheduled send time)",
                "columns": [
                    "route",
                    "system",
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
