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

Memory is accounted by what holds it, sampled together: the producer's
payload buffers still alive (what taproute's bounds govern: ingress,
mailbox, the ClickHouse sink's buffer), chDB's own tracked memory
(ClickHouse's ``MemoryTracking``: Arrow to columns, compression, parts,
merges; no taproute setting bounds it), and what glibc's malloc keeps in
its free lists after the payloads are freed (``mallinfo2``); RSS growth
is reported beside them.  A slow ``submit_batch`` is split into the
producer thread's CPU time, its wait for a core (``/proc`` schedstat run
queue) and the rest (the GIL, the ingress lock).
"""

from __future__ import annotations

import ctypes
import tempfile
import threading
import time
import weakref
from pathlib import Path
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


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _mallinfo() -> Any:
    """glibc's ``mallinfo2`` (None elsewhere)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        return libc.mallinfo2
    except (OSError, AttributeError):
        return None


class Payloads:
    """Allocates the producer's payload buffers and counts the bytes of
    those still alive (whoever holds them: ingress, mailbox, the sink)."""

    def __init__(self) -> None:
        self.live_bytes = 0
        self._lock = threading.Lock()

    def new(self, i: int) -> np.ndarray:
        payload = np.full(PER_BATCH * RECORD // 4, i % 251, dtype=np.float32)
        with self._lock:
            self.live_bytes += payload.nbytes
        weakref.finalize(payload, self._gone, payload.nbytes)
        return payload

    def _gone(self, nbytes: int) -> None:
        with self._lock:
            self.live_bytes -= nbytes


class Sampler:
    """Samples RSS, live payload bytes, malloc's free lists, the runtime's
    counters and the ClickHouse sink's buffered + in-flight rows every 20 ms,
    and chDB's tracked memory every 100 ms (a query); keeps the peaks and,
    at the RSS peak, what held the memory then."""

    def __init__(
        self,
        runtime: Any | None,
        sinks: list[ClickHouseSink],
        payloads: Payloads,
        query: Any = None,
    ) -> None:
        self.runtime, self.sinks, self.payloads, self.query = runtime, sinks, payloads, query
        self.process = psutil.Process()
        self.baseline = self.process.memory_info().rss
        self.mallinfo = _mallinfo()
        self.free_baseline = self._malloc_free()
        self.chdb_baseline = self._chdb_tracked()
        self.chdb_now = 0
        self.peak: dict[str, int] = {
            "rss_growth_bytes": 0,
            "live_payload_bytes": 0,
            "chdb_tracked_bytes": 0,
            "malloc_free_held_bytes": 0,
            "ingress_queued_records": 0,
            "destination_queue_depth": 0,
            "clickhouse_pending_bytes": 0,
        }
        #: What held the memory when RSS peaked.
        self.at_rss_peak: dict[str, int] = {}
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, daemon=True),
            threading.Thread(target=self._run_chdb, daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _malloc_free(self) -> int:
        return 0 if self.mallinfo is None else int(self.mallinfo().fordblks)

    def _chdb_tracked(self) -> int:
        query = self.query
        if query is None and self.sinks:
            query = self.sinks[0].query
        if query is None:
            return 0
        sql = "SELECT value FROM system.metrics WHERE metric = 'MemoryTracking'"
        try:
            return int(query(sql).column("value")[0].as_py())
        except Exception:  # the sink is closing: keep the last figure
            return self.chdb_now

    def _run_chdb(self) -> None:
        while not self._stop.wait(0.1):
            self.chdb_now = self._chdb_tracked()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            peak = self.peak
            now = {
                "rss_growth_bytes": self.process.memory_info().rss - self.baseline,
                "live_payload_bytes": self.payloads.live_bytes,
                # Growth since the soak started (negative: chDB freed what an
                # earlier soak's merges held; its allocator may keep the pages).
                "chdb_tracked_bytes": self.chdb_now - self.chdb_baseline,
                "chdb_tracked_total_bytes": self.chdb_now,
                "malloc_free_held_bytes": self._malloc_free() - self.free_baseline,
            }
            if now["rss_growth_bytes"] > peak["rss_growth_bytes"]:
                self.at_rss_peak = dict(now)
            for name, value in now.items():
                peak[name] = max(peak.get(name, 0), value)
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
        for thread in self._threads:
            thread.join()
        return self.peak


def _run_queue_s() -> float:
    """Seconds this thread has waited for a core (Linux schedstat; 0 elsewhere)."""
    try:
        text = Path(f"/proc/self/task/{threading.get_native_id()}/schedstat").read_text()
    except OSError:
        return 0.0
    return int(text.split()[1]) / 1e9


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
    hold_cpu: list[float] = []
    hold_run_queue: list[float] = []
    payloads = Payloads()
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
        sampler = Sampler(runtime, made, payloads)
        started = time.perf_counter()
        i = 0
        while time.perf_counter() - started < duration:
            hook = hooks[i % len(hooks)]
            i += 1
            payload = payloads.new(i)
            offered += 1
            q0, c0, t0 = _run_queue_s(), time.thread_time(), time.perf_counter()
            try:
                runtime.submit_batch(descs[hook], payload)
                accepted += 1
                accepted_by_hook[hook] += 1
            except IngressFull:
                rejected += 1
                hold.append(time.perf_counter() - t0)
                hold_cpu.append(time.thread_time() - c0)
                hold_run_queue.append(_run_queue_s() - q0)
                time.sleep(0.0005)  # a server would shed and go on serving
                continue
            hold.append(time.perf_counter() - t0)
            hold_cpu.append(time.thread_time() - c0)
            hold_run_queue.append(_run_queue_s() - q0)
        produced = time.perf_counter() - started
        fast_at_end_of_production = fast.records
        runtime.flush()
        drained = time.perf_counter() - started
        peaks = sampler.stop()
        counters = runtime.counters()
        in_clickhouse = count_rows(made[0], table) if made else 0
    blocked = counters.ingress.blocked_seconds if counters.ingress else 0.0
    hold_ms = sorted(h * 1000 for h in hold)
    # Where the slow calls' time went: CPU, waiting for a core, the rest.
    slow = [k for k, h in enumerate(hold) if h > 0.001]
    slow_wall = sum(hold[k] for k in slow)
    slow_split = {
        "calls_over_1ms": len(slow),
        "cpu_share": sum(hold_cpu[k] for k in slow) / slow_wall if slow else 0.0,
        "run_queue_share": min(1.0, sum(hold_run_queue[k] for k in slow) / slow_wall)
        if slow
        else 0.0,
    }
    slow_split["other_share"] = max(
        0.0, 1 - slow_split["cpu_share"] - slow_split["run_queue_share"]
    )
    cpu_ms = sorted(c * 1000 for c in hold_cpu)
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
        "submit_cpu_ms": {"p50": cpu_ms[len(cpu_ms) // 2], "p99": cpu_ms[int(len(cpu_ms) * 0.99)]},
        "slow_submits": slow_split,
        "peaks": peaks,
        "at_rss_peak": sampler.at_rss_peak,
    }


def bare_soak(folder: str, duration: float) -> dict[str, Any]:
    """The peer: the producer converts its batches to Arrow itself and inserts
    blocks of the sink's insert size into the same chDB directory,
    synchronously, for the same time (no taproute, no threads)."""
    transport = ChdbTransport(folder)
    table = f"soak_bare_{time.time_ns()}"
    layout = SCHEMA.layout(SHAPE)
    spec = raw_table_spec(layout, table)
    transport.execute(spec.create_sql(transport.table_settings))  # as the sink creates it
    hooks = HookRegistry()
    hook = hooks.bind("a", layout=SHAPE)
    desc = descriptors(hook, SHAPE, PER_BATCH)
    payloads = Payloads()
    sampler = Sampler(None, [], payloads, query=transport.query)
    pending: list[Any] = []
    pending_bytes = rows = blocks = 0
    started = time.perf_counter()
    try:
        i = 0
        while time.perf_counter() - started < duration:
            i += 1
            payload = payloads.new(i)
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
        "peaks": peaks,
        "at_rss_peak": sampler.at_rss_peak,
    }


def _holders(soak: dict[str, Any], bound: int) -> int:
    """What the known holders may account for: taproute's byte bounds, the
    growth of chDB's tracked memory, the growth of malloc's free lists (each
    at its peak)."""
    peaks = soak["peaks"]
    return bound + max(0, peaks["chdb_tracked_bytes"]) + max(0, peaks["malloc_free_held_bytes"])


def _memory_detail(soak: dict[str, Any], bound: int) -> str:
    at = soak["at_rss_peak"]
    peaks = soak["peaks"]
    return (
        f"peak RSS growth {peaks['rss_growth_bytes'] / MiB:.1f} MiB vs "
        f"{_holders(soak, bound) / MiB:.1f} MiB = bounds {bound / MiB:.1f} + chDB "
        f"{max(0, peaks['chdb_tracked_bytes']) / MiB:.1f} + malloc free lists "
        f"{max(0, peaks['malloc_free_held_bytes']) / MiB:.1f}; at the RSS peak: "
        f"live payload {at.get('live_payload_bytes', 0) / MiB:.1f} MiB, chDB tracked "
        f"{at.get('chdb_tracked_total_bytes', 0) / MiB:.1f} MiB "
        f"({at.get('chdb_tracked_bytes', 0) / MiB:+.1f} since the start), malloc free lists "
        f"{at.get('malloc_free_held_bytes', 0) / MiB:+.1f} MiB"
    )


def _slow_detail(soak: dict[str, Any]) -> str:
    split = soak["slow_submits"]
    return (
        f"{split['calls_over_1ms']} calls over 1 ms spent {split['cpu_share']:.0%} of their time "
        f"on CPU, {split['run_queue_share']:.0%} waiting for a core, "
        f"{split['other_share']:.0%} waiting otherwise (GIL, lock)"
    )


def main() -> None:
    args = arguments(__doc__, repeat=(1, 1), duration=(8.0, 2.0))
    bounds = {
        "ingress_queued_records": INGRESS_BYTES // RECORD,
        "destination_queue_depth": MAILBOX_BYTES // RECORD,
        "clickhouse_pending_bytes": CH_BUFFER_BYTES + int(BATCHING.max_bytes),
        # Every payload buffer alive is in one of the three bounded places (or
        # in the producer's or an actor's hand: one batch each, within the slack).
        "live_payload_bytes": INGRESS_BYTES
        + MAILBOX_BYTES
        + CH_BUFFER_BYTES
        + int(BATCHING.max_bytes),
    }
    rss_bound = int(1.1 * bounds["live_payload_bytes"])
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
            "slow ClickHouse: peak RSS growth <= byte bounds (+10%) + chDB's and malloc's "
            "growth (nothing else holds memory)",
            block["peaks"]["rss_growth_bytes"] <= _holders(block, rss_bound),
            _memory_detail(block, rss_bound),
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
            f"max {reject['submit_hold_ms']['max']:.3f} ms; " + _slow_detail(reject),
        ),
        target(
            "reject mode: submit_batch p99 CPU (the producer's own work) < 1 ms",
            reject["submit_cpu_ms"]["p99"] < 1,
            f"p99 {reject['submit_cpu_ms']['p99']:.3f} ms",
        ),
        target(
            "reject mode: peak live payload <= the byte bounds",
            reject["peaks"]["live_payload_bytes"] <= bounds["live_payload_bytes"],
            f"{reject['peaks']['live_payload_bytes'] / MiB:.1f} MiB vs "
            f"{bounds['live_payload_bytes'] / MiB:.1f} MiB",
        ),
        target(
            "reject mode: peak RSS growth <= byte bounds (+10%) + chDB's and malloc's "
            "growth (nothing else holds memory)",
            reject["peaks"]["rss_growth_bytes"] <= _holders(reject, rss_bound),
            _memory_detail(reject, rss_bound),
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
        f"{block['peaks']['rss_growth_bytes'] / MiB:.1f} MiB, live payload at most "
        f"{block['peaks']['live_payload_bytes'] / MiB:.1f} MiB against "
        f"{bounds['live_payload_bytes'] / MiB:.1f} MiB of configured byte bounds; "
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
        f" ms, max {reject['submit_hold_ms']['max']:.3f} ms, using p99 "
        f"{reject['submit_cpu_ms']['p99']:.3f} ms of CPU; {_slow_detail(reject)}.",
        "Memory by holder, slow ClickHouse: " + _memory_detail(block, rss_bound) + "; reject "
        "mode: "
        + _memory_detail(reject, rss_bound)
        + "; the direct-insert peer: "
        + _memory_detail(bare, rss_bound)
        + ". chDB's tracked memory is its own working memory for inserts and merges, which "
        "no taproute setting bounds; malloc's free lists hold payload buffers freed since "
        "(the producer allocates a fresh one per batch; capture hooks reuse a pool).",
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
            r["peaks"]["live_payload_bytes"] / MiB,
            r["peaks"]["chdb_tracked_bytes"] / MiB,
            r["peaks"]["malloc_free_held_bytes"] / MiB,
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
                    "peak live payload MiB",
                    "peak chDB tracked MiB",
                    "peak malloc free lists MiB",
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
