"""Overload: what taproute does when the producer outruns a destination.

The producer submits as fast as it can, each batch a freshly allocated
buffer (128 MiniLM token records, 192 KiB), for ``--duration`` seconds:

- slow ClickHouse: a forward route into a real ClickHouse sink (chDB, its
  insert is the bottleneck).  Checked: every submitted row is counted in
  ClickHouse after ``flush()`` (in == out); memory against every configured
  bound, sampled every 20 ms: ingress queue (records), destination mailbox
  (records), the ClickHouse sink's buffered + in-flight bytes, and process
  RSS growth against the sum of the byte bounds;
- head-of-line: hook A -> the slow ClickHouse sink, hook B -> a fast
  destination copying the bytes, batches alternating; B's delivered rate is
  compared with B alone (what a slow destination costs a fast one);
- reject mode (``when_full="reject"``) into the slow ClickHouse sink:
  accepted vs refused batches, delivered == accepted, and how long
  ``submit_batch`` holds the producer (it should never wait).
"""

from __future__ import annotations

import tempfile
import threading
import time
from typing import Any

import numpy as np
import psutil
import pyarrow as pa
from _workload import CopySink, descriptors, layout_for
from harness import arguments, comparison, fmt, summary, target, write_result

from taproute.routing import HookRegistry
from taproute.service import (
    Batching,
    ClickHouseSink,
    IngressFull,
    RecordBatch,
    RecordSchema,
    Route,
    RoutingConfig,
    RoutingSink,
    create_record_runtime,
)
from taproute.service.sinks.clickhouse import ChdbTransport
from taproute.service.sinks.clickhouse.columns import raw_table
from taproute.service.sinks.clickhouse.tables import raw_table_spec

SHAPE = "minilm_token"
PER_BATCH = 128
RECORD = 384 * 4
SCHEMA = RecordSchema([layout_for(SHAPE)])
MiB = 2**20
INGRESS_BYTES = 16 * MiB
MAILBOX_BYTES = 16 * MiB
CH_BUFFER_BYTES = 32 * MiB
BATCHING = Batching(max_bytes=4 * MiB, linger=0.2, max_buffered_bytes=CH_BUFFER_BYTES)


class Sampler:
    """Samples RSS, the runtime's counters and the ClickHouse sink's
    buffered + in-flight rows every 20 ms; keeps the peaks."""

    def __init__(self, runtime: Any | None, sinks: list[ClickHouseSink]) -> None:
        self.runtime, self.sinks = runtime, sinks
        self.process = psutil.Process()
        self.baseline = self.process.memory_info().rss
        self.peak: dict[str, int] = {
            "rss_growth_bytes": 0,
            "ingress_queued_records": 0,
            "destination_queue_depth": 0,
            "clickhouse_pending_bytes": 0,
        }
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            peak = self.peak
            peak["rss_growth_bytes"] = max(
                peak["rss_growth_bytes"], self.process.memory_info().rss - self.baseline
            )
            if self.runtime is None:
                continue
            snap = self.runtime.counters()
            if snap.ingress is not None:
                peak["ingress_queued_records"] = max(
                    peak["ingress_queued_records"], snap.ingress.queued
                )
            depth = max((d.queue_depth for d in snap.destinations.values()), default=0)
            peak["destination_queue_depth"] = max(peak["destination_queue_depth"], depth)
            pending = sum(
                (c.buffered_rows + c.in_flight_rows) * RECORD
                for sink in self.sinks
                for c in sink.table_counters().values()
            )
            peak["clickhouse_pending_bytes"] = max(peak["clickhouse_pending_bytes"], pending)

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        return self.peak


def clickhouse_factory(folder: str, table: str, made: list[ClickHouseSink]) -> Any:
    def factory() -> ClickHouseSink:
        sink = ClickHouseSink.embedded(
            SCHEMA, folder, raw=[SHAPE], raw_table=table, batching=BATCHING
        )
        made.append(sink)
        return sink

    return factory


def count_rows(sink: ClickHouseSink, table: str) -> int:
    return int(sink.query(f"SELECT count() AS n FROM `{table}`").column("n")[0].as_py())


def soak(
    folder: str,
    duration: float,
    *,
    with_slow: bool = True,
    with_fast: bool = False,
    when_full: str = "block",
    tag: str = "",
) -> dict[str, Any]:
    """One soak; returns its figures."""
    made: list[ClickHouseSink] = []
    table = f"soak_{tag}_{time.time_ns()}"
    routes, dests = [], {}
    if with_slow:
        routes.append(Route("slow", "a", "ch"))
        dests["ch"] = clickhouse_factory(folder, table, made)
    fast = CopySink()
    if with_fast:
        routes.append(Route("fast", "b", "copy"))
        dests["copy"] = fast
    router = RoutingSink(
        RoutingConfig(routes),
        SCHEMA,
        dests,
        unmatched="drop",
        destination_capacity=MAILBOX_BYTES // RECORD,
        destination_capacity_bytes=MAILBOX_BYTES,
    )
    hold: list[float] = []
    offered = accepted = rejected = 0
    accepted_by_hook = {"a": 0, "b": 0}
    with create_record_runtime(
        record_sink=router,
        capacity_records=INGRESS_BYTES // RECORD,
        capacity_bytes=INGRESS_BYTES,
        when_full=when_full,  # type: ignore[arg-type]
    ) as runtime:
        ids = {"a": runtime.bind_hook("a", layout=SHAPE), "b": runtime.bind_hook("b", layout=SHAPE)}
        hooks = [h for h, on in (("a", with_slow), ("b", with_fast)) if on]
        descs = {h: descriptors(ids[h], SHAPE, PER_BATCH) for h in hooks}
        sampler = Sampler(runtime, made)
        started = time.perf_counter()
        i = 0
        while time.perf_counter() - started < duration:
            hook = hooks[i % len(hooks)]
            i += 1
            payload = np.full(PER_BATCH * RECORD // 4, i % 251, dtype=np.float32)
            offered += 1
            t0 = time.perf_counter()
            try:
                runtime.submit_batch(descs[hook], payload)
                accepted += 1
                accepted_by_hook[hook] += 1
            except IngressFull:
                rejected += 1
                time.sleep(0.0005)  # a server would shed and go on serving
            hold.append(time.perf_counter() - t0)
        produced = time.perf_counter() - started
        fast_at_end_of_production = fast.records
        runtime.flush()
        drained = time.perf_counter() - started
        peaks = sampler.stop()
        counters = runtime.counters()
        in_clickhouse = count_rows(made[0], table) if made else 0
    blocked = counters.ingress.blocked_seconds if counters.ingress else 0.0
    hold_ms = sorted(h * 1000 for h in hold)
    return {
        "duration_s": produced,
        "drained_s": drained,
        "offered_batches": offered,
        "accepted_batches": accepted,
        "rejected_batches": rejected,
        "accepted_slow_records": accepted_by_hook["a"] * PER_BATCH,
        "accepted_fast_records": accepted_by_hook["b"] * PER_BATCH,
        "rows_in_clickhouse": in_clickhouse,
        "fast_delivered_records": fast.records,
        "fast_delivered_per_s_while_producing": fast_at_end_of_production / produced,
        "slow_rows_per_s": in_clickhouse / drained,
        "producer_blocked_s": blocked,
        "producer_blocked_share": blocked / produced,
        "submit_hold_ms": {
            "p50": hold_ms[len(hold_ms) // 2],
            "p99": hold_ms[int(len(hold_ms) * 0.99)],
            "max": hold_ms[-1],
        },
        "peaks": peaks,
    }


def bare_soak(folder: str, duration: float) -> dict[str, Any]:
    """The peer: the producer converts its batches to Arrow itself and inserts
    blocks of the sink's insert size into the same chDB directory,
    synchronously, for the same time (no taproute, no threads)."""
    transport = ChdbTransport(folder)
    table = f"soak_bare_{time.time_ns()}"
    layout = SCHEMA.layout(SHAPE)
    spec = raw_table_spec(layout, table)
    transport.execute(spec.create_sql())
    hooks = HookRegistry()
    hook = hooks.bind("a", layout=SHAPE)
    desc = descriptors(hook, SHAPE, PER_BATCH)
    sampler = Sampler(None, [])
    pending: list[Any] = []
    pending_bytes = rows = blocks = 0
    started = time.perf_counter()
    try:
        i = 0
        while time.perf_counter() - started < duration:
            i += 1
            payload = np.full(PER_BATCH * RECORD // 4, i % 251, dtype=np.float32)
            pending.append(
                raw_table(RecordBatch.from_buffer(desc, payload), layout, spec, hooks.names())
            )
            pending_bytes += PER_BATCH * RECORD
            rows += PER_BATCH
            if pending_bytes >= BATCHING.max_bytes:
                blocks += 1
                transport.insert(table, pa.concat_tables(pending), dedup_token=f"bare-{blocks}")
                pending, pending_bytes = [], 0
        produced = time.perf_counter() - started
        if pending:
            blocks += 1
            transport.insert(table, pa.concat_tables(pending), dedup_token=f"bare-{blocks}")
        drained = time.perf_counter() - started
        peaks = sampler.stop()
        counted = int(transport.query(f"SELECT count() AS n FROM `{table}`").column("n")[0].as_py())
    finally:
        transport.close()
    return {
        "duration_s": produced,
        "drained_s": drained,
        "rows": rows,
        "rows_in_clickhouse": counted,
        "rows_per_s": counted / drained,
        "rss_growth_bytes": peaks["rss_growth_bytes"],
    }


def main() -> None:
    args = arguments(__doc__, repeat=(1, 1), duration=(8.0, 2.0))
    bounds = {
        "ingress_queued_records": INGRESS_BYTES // RECORD,
        "destination_queue_depth": MAILBOX_BYTES // RECORD,
        "clickhouse_pending_bytes": CH_BUFFER_BYTES + int(BATCHING.max_bytes),
        "rss_growth_bytes": int(1.1 * (INGRESS_BYTES + MAILBOX_BYTES + CH_BUFFER_BYTES)),
    }
    with tempfile.TemporaryDirectory() as folder:
        # Unrecorded: chDB's one-time engine start and first inserts are not
        # growth under overload.
        soak(folder, min(1.0, args.duration), tag="warmup")
        block = soak(folder, args.duration, tag="block")
        fast_alone = soak(folder, args.duration, with_slow=False, with_fast=True, tag="fast")
        hol = soak(folder, args.duration, with_fast=True, tag="hol")
        reject = soak(folder, args.duration, when_full="reject", tag="reject")
        bare = bare_soak(folder, args.duration)
    targets = [
        target(
            "slow ClickHouse: in == out (rows counted)",
            block["rows_in_clickhouse"] == block["accepted_slow_records"],
            f"{block['accepted_slow_records']:,} submitted, "
            f"{block['rows_in_clickhouse']:,} in ClickHouse",
        ),
        *[
            target(
                f"slow ClickHouse: peak {name} <= its bound",
                block["peaks"][name] <= bound,
                f"peak {block['peaks'][name]:,} vs bound {bound:,}",
            )
            for name, bound in bounds.items()
        ],
        target(
            "slow ClickHouse: peak RSS growth <= byte bounds (+10%) + the direct-insert peer's",
            block["peaks"]["rss_growth_bytes"]
            <= bounds["rss_growth_bytes"] + bare["rss_growth_bytes"],
            f"{block['peaks']['rss_growth_bytes'] / MiB:.1f} MiB vs "
            f"{bounds['rss_growth_bytes'] / MiB:.1f} + {bare['rss_growth_bytes'] / MiB:.1f} MiB",
        ),
        target(
            "reject mode: delivered == accepted",
            reject["rows_in_clickhouse"] == reject["accepted_slow_records"],
            f"{reject['accepted_slow_records']:,} accepted, "
            f"{reject['rows_in_clickhouse']:,} in ClickHouse, "
            f"{reject['rejected_batches']:,} batches refused",
        ),
        target(
            "reject mode: submit_batch p99 hold < 1 ms",
            reject["submit_hold_ms"]["p99"] < 1,
            f"p99 {reject['submit_hold_ms']['p99']:.3f} ms, "
            f"max {reject['submit_hold_ms']['max']:.3f} ms",
        ),
        target(
            "reject mode: memory within bounds (peak RSS growth)",
            reject["peaks"]["rss_growth_bytes"] <= bounds["rss_growth_bytes"],
            f"{reject['peaks']['rss_growth_bytes'] / MiB:.1f} MiB vs "
            f"{bounds['rss_growth_bytes'] / MiB:.1f} MiB",
        ),
    ]
    comparisons = [
        comparison(
            "overload into chDB: rows persisted per second (one soak each)",
            summary([block["slow_rows_per_s"]]),
            summary([bare["rows_per_s"]]),
            taproute_label="taproute forward route -> ClickHouseSink",
            peer_label="producer converting + inserting blocks itself",
            unit="rows/s",
        ),
        comparison(
            "overload into chDB: peak RSS growth",
            summary([block["peaks"]["rss_growth_bytes"] / MiB]),
            summary([bare["rss_growth_bytes"] / MiB]),
            taproute_label="taproute forward route -> ClickHouseSink",
            peer_label="producer converting + inserting blocks itself",
            unit="MiB",
            higher_is_better=False,
        ),
    ]
    hol_ratio = (
        hol["fast_delivered_per_s_while_producing"]
        / fast_alone["fast_delivered_per_s_while_producing"]
    )
    notes = [
        f"Slow ClickHouse: {fmt(block['slow_rows_per_s'])} rows/s persisted; the producer was "
        f"blocked {block['producer_blocked_share']:.0%} of the time; peak RSS growth "
        f"{block['peaks']['rss_growth_bytes'] / MiB:.1f} MiB against "
        f"{bounds['rss_growth_bytes'] / MiB:.1f} MiB of configured byte bounds (+10%); "
        "RSS also holds chDB's own working memory (parts, merges, Arrow conversion), "
        "which no taproute setting bounds: the same inserts made directly by the producer "
        f"grew RSS by {bare['rss_growth_bytes'] / MiB:.1f} MiB "
        f"({fmt(bare['rows_per_s'])} rows/s persisted).",
        f"Head-of-line: the fast destination got {fmt(hol['fast_delivered_per_s_while_producing'])}"
        f" records/s beside the slow one against "
        f"{fmt(fast_alone['fast_delivered_per_s_while_producing'])} alone ({hol_ratio:.3f}x): "
        + (
            "a slow destination throttles a fast one sharing the record worker once its "
            "mailbox is full."
            if hol_ratio < 0.5
            else "the slow destination did not hold the fast one back much."
        ),
        f"Reject mode: {reject['accepted_batches']:,} batches accepted, "
        f"{reject['rejected_batches']:,} refused; submit_batch held the producer "
        f"p50 {reject['submit_hold_ms']['p50']:.3f} ms, p99 {reject['submit_hold_ms']['p99']:.3f}"
        f" ms, max {reject['submit_hold_ms']['max']:.3f} ms.",
    ]
    rows = [
        [
            name,
            r["duration_s"],
            r["accepted_batches"],
            r["rejected_batches"],
            r["rows_in_clickhouse"],
            r["fast_delivered_records"],
            r["producer_blocked_share"],
            r["submit_hold_ms"]["p99"],
            r["peaks"]["rss_growth_bytes"] / MiB,
        ]
        for name, r in (
            ("slow ClickHouse", block),
            ("fast alone", fast_alone),
            ("slow + fast (head-of-line)", hol),
            ("reject mode", reject),
        )
    ]
    write_result(
        "overload_soak",
        title="Overload: slow ClickHouse, head-of-line, reject mode",
        description=__doc__.split("\n\n")[0],
        params={
            "shape": SHAPE,
            "records_per_batch": PER_BATCH,
            "duration_s": args.duration,
            "ingress_bytes": INGRESS_BYTES,
            "mailbox_bytes": MAILBOX_BYTES,
            "clickhouse_max_buffered_bytes": CH_BUFFER_BYTES,
            "clickhouse_batching": {"max_bytes": BATCHING.max_bytes, "linger": BATCHING.linger},
            "bounds": bounds,
        },
        quick=args.quick,
        comparisons=comparisons,
        tables=[
            {
                "title": "Soaks",
                "columns": [
                    "soak",
                    "produce s",
                    "accepted batches",
                    "refused batches",
                    "rows in ClickHouse",
                    "fast records",
                    "producer blocked share",
                    "submit hold p99 ms",
                    "peak RSS growth MiB",
                ],
                "rows": rows,
            }
        ],
        targets=targets,
        notes=notes,
        raw={
            "block": block,
            "fast_alone": fast_alone,
            "head_of_line": hol,
            "reject": reject,
            "hold_summary": summary([block["submit_hold_ms"]["p99"]]),
        },
    )


if __name__ == "__main__":
    main()
