"""Route chains: a route's output routed again, under the causal limits,
against a thread running the same two stages back to back, and the bare
functions.

Two stages per batch of captured vectors (64 float32 each): stage 1 turns
each record into a (key, norm) row, stage 2 scales every row again; each
stage's rows are copied by a destination.  Same batches, same run,
interleaved:

- taproute: route ``norms`` with ``then=("scaled",)``, route ``scaled``
  taking ``route:norms`` (stage 1's rows become derived records, one per
  row, no copy, each admitted by the causal limits: one new root per
  captured record), through the threaded runtime; the clock stops when
  ``flush()`` returns;
- thread + ``queue.Queue`` of batches (bounded): a consumer thread runs
  stage 1, copies, stage 2, copies, per batch;
- bare: the same calls in a loop, no framework: the floor;
- taproute without a chain: two routes fanned out from the hook, the same
  number of processor calls and deliveries: what chaining itself costs.

A table adds what the causal limits' root ledger costs per batch alone
(admitting 1024 derived records of new roots, and of roots already known).
The final rows of all three are checked equal before anything is timed.
"""

from __future__ import annotations

import queue
import threading
import time

import numpy as np
from _workload import Copier, CopySink, copy_into
from harness import (
    arguments,
    comparison,
    interleave,
    submit_rate,
    summary,
    timed_rate,
    write_result,
)

from taproute.routing.causal import CausalLimits
from taproute.routing.root_ledger import RootLedger
from taproute.service import (
    Layout,
    Records,
    RecordSchema,
    Route,
    RoutingConfig,
    RoutingSink,
    create_record_runtime,
    stateless_processor,
)

WIDTH = 64
PER_BATCH = 1024
VEC = Layout("vec", [("values", "Array(Float32)", (WIDTH,))])
NORM = Layout("norm", [("key", "Int64"), ("norm", "Float32")])
SCHEMA = RecordSchema([VEC, NORM])


def stage1(keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    rows = np.empty(len(keys), dtype=NORM.dtype)
    rows["key"] = keys
    rows["norm"] = np.linalg.norm(values, axis=1)
    return rows


def stage2(rows: np.ndarray) -> np.ndarray:
    out = np.array(rows, dtype=NORM.dtype)
    out["norm"] *= 0.5
    return out


@stateless_processor("bench.chain_norms", input="vec", output="norm")
def chain_norms(records: Records) -> np.ndarray:
    return stage1(records.descriptors["key"], records.rows()["values"])


@stateless_processor("bench.chain_scaled", input="norm", output="norm")
def chain_scaled(records: Records) -> np.ndarray:
    return stage2(records.rows())


def make_batches(n: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    keys = np.arange(n, dtype=np.int64)
    values = rng.standard_normal((n, WIDTH), dtype=np.float32)
    return [(keys[i : i + PER_BATCH], values[i : i + PER_BATCH]) for i in range(0, n, PER_BATCH)]


class KeepingSink(CopySink):
    """Copies rows like any destination; keeps them only for the equality check."""

    def __init__(self, keep: bool) -> None:
        super().__init__()
        self.keep = keep
        self.seen: list[np.ndarray] = []

    async def submit(self, batch: object) -> None:
        await super().submit(batch)
        if self.keep:
            self.seen.append(batch.rows.copy())  # type: ignore[attr-defined]


def taproute_run(batches: list, keep: bool = False) -> tuple[float, list[np.ndarray]]:
    first, second = KeepingSink(False), KeepingSink(keep)
    config = RoutingConfig(
        [
            Route(
                "norms",
                "vectors",
                "first",
                mode="stateless",
                processor="bench.chain_norms",
                then=("scaled",),
            ),
            Route(
                "scaled", "route:norms", "second", mode="stateless", processor="bench.chain_scaled"
            ),
        ],
        # Every record is its own root here: the limits never refuse, the
        # ledger still admits (and pins) every derived record.
        causal_limits=CausalLimits(),
    )
    sink = RoutingSink(config, SCHEMA, {"first": first, "second": second}, unmatched="drop")
    n = sum(len(k) for k, _ in batches)
    with create_record_runtime(record_sink=sink) as runtime:
        rate = submit_rate(runtime, batches, record_bytes=WIDTH * 4)
        derived = runtime.counters().causal.derived
    assert derived == n, f"{derived} derived records, expected {n}"
    return rate, second.seen


def fanout_run(batches: list) -> float:
    """taproute without a chain: two routes take the captured records (stage 1
    twice), so the run makes the same number of processor calls and deliveries
    as the chain; the difference is what chaining itself costs."""
    first, second = KeepingSink(False), KeepingSink(False)
    config = RoutingConfig(
        [
            Route("norms", "vectors", "first", mode="stateless", processor="bench.chain_norms"),
            Route("again", "vectors", "second", mode="stateless", processor="bench.chain_norms"),
        ]
    )
    sink = RoutingSink(config, SCHEMA, {"first": first, "second": second}, unmatched="drop")
    with create_record_runtime(record_sink=sink) as runtime:
        return submit_rate(runtime, batches, record_bytes=WIDTH * 4)


def thread_run(batches: list, keep: bool = False) -> tuple[float, list[np.ndarray]]:
    inbox: queue.Queue[tuple[np.ndarray, np.ndarray] | None] = queue.Queue(maxsize=64)
    first, second = Copier(), Copier()
    seen: list[np.ndarray] = []

    def consumer() -> None:
        while (item := inbox.get()) is not None:
            rows = stage1(*item)
            copy_into(first, rows.view(np.uint8).reshape(-1))
            scaled = stage2(rows)
            copy_into(second, scaled.view(np.uint8).reshape(-1))
            if keep:
                seen.append(scaled.copy())

    def body() -> None:
        worker = threading.Thread(target=consumer)
        worker.start()
        for keys, values in batches:
            inbox.put((keys, values))
        inbox.put(None)
        worker.join()

    n = sum(len(k) for k, _ in batches)
    return timed_rate(n, body), seen


def bare_run(batches: list, keep: bool = False) -> tuple[float, list[np.ndarray]]:
    first, second = Copier(), Copier()
    seen: list[np.ndarray] = []

    def body() -> None:
        for keys, values in batches:
            rows = stage1(keys, values)
            copy_into(first, rows.view(np.uint8).reshape(-1))
            scaled = stage2(rows)
            copy_into(second, scaled.view(np.uint8).reshape(-1))
            if keep:
                seen.append(scaled.copy())

    n = sum(len(k) for k, _ in batches)
    return timed_rate(n, body), seen


def ledger_costs(rounds: int) -> dict[str, dict[str, float]]:
    """Microseconds to admit one batch of PER_BATCH derived records, of new roots
    and of roots admitted before (same minute), into a ledger holding a minute's
    worth of earlier roots."""
    rng = np.random.default_rng(1)
    limits = CausalLimits(per_root_per_minute=1 << 20)
    depths = np.ones(PER_BATCH, np.int32)
    new_samples: list[float] = []
    known_samples: list[float] = []
    for _ in range(rounds):
        ledger = RootLedger()
        ledger.admit(
            rng.integers(-(2**62), 2**62, 100_000), np.ones(100_000, np.int32), 0.0, limits
        )
        roots = rng.integers(-(2**62), 2**62, PER_BATCH)
        started = time.perf_counter()
        ledger.admit(roots, depths, 1.0, limits)
        new_samples.append((time.perf_counter() - started) * 1e6)
        started = time.perf_counter()
        ledger.admit(roots, depths, 2.0, limits)
        known_samples.append((time.perf_counter() - started) * 1e6)
    return {"new roots": summary(new_samples), "known roots": summary(known_samples)}


def main() -> None:
    args = arguments(__doc__, repeat=(5, 2), records=(400_000, 60_000))
    batches = make_batches(args.records)
    check = batches[: max(2, len(batches) // 4)]
    ours = np.concatenate(taproute_run(check, keep=True)[1])
    peer = np.concatenate(thread_run(check, keep=True)[1])
    floor = np.concatenate(bare_run(check, keep=True)[1])
    ours = np.sort(ours, order="key")  # two workers may deliver batches out of order
    assert ours.tolist() == peer.tolist() == floor.tolist(), "engines disagree"
    got = interleave(
        {
            "taproute, chain of 2 routes": lambda: taproute_run(batches)[0],
            "taproute, 2 routes fanned out (no chain)": lambda: fanout_run(batches),
            "thread + queue, 2 stages": lambda: thread_run(batches)[0],
            "bare functions": lambda: bare_run(batches)[0],
        },
        repeat=args.repeat,
    )
    ledger = ledger_costs(max(3, args.repeat * 3))
    what = f"2-stage chain, {WIDTH} float32 per record, {PER_BATCH}/batch"
    comparisons = [
        comparison(
            what,
            got["taproute, chain of 2 routes"],
            got[peer_name],
            taproute_label="taproute, chain of 2 routes",
            peer_label=peer_name,
            unit="records/s",
        )
        for peer_name in ("thread + queue, 2 stages", "bare functions")
    ]
    fanned = got["taproute, 2 routes fanned out (no chain)"]
    chained = got["taproute, chain of 2 routes"]
    overhead = {
        "title": "what chaining costs: the chain against the same calls fanned out",
        "columns": ["variant", "median records/s", "min", "max"],
        "rows": [
            [name, f"{s['median']:,.0f}", f"{s['min']:,.0f}", f"{s['max']:,.0f}"]
            for name, s in (("chain of 2 routes", chained), ("2 routes fanned out", fanned))
        ],
    }
    table = {
        "title": f"root ledger: admitting {PER_BATCH} derived records (100k roots held)",
        "columns": ["roots", "median us", "min us", "max us"],
        "rows": [
            [name, f"{s['median']:.0f}", f"{s['min']:.0f}", f"{s['max']:.0f}"]
            for name, s in ledger.items()
        ],
    }
    t = got["taproute, chain of 2 routes"]["median"]
    notes = [
        f"taproute's chain ran at {t:,.0f} records/s, "
        f"{t / got['thread + queue, 2 stages']['median']:.2f}x the thread + queue peer and "
        f"{t / got['bare functions']['median']:.2f}x the bare functions, "
        f"{t / fanned['median']:.2f}x taproute making the same calls without a chain; "
        "the root ledger "
        f"admitted a batch of new roots in {ledger['new roots']['median']:.0f} us "
        f"({ledger['new roots']['median'] * 1e3 / PER_BATCH:.0f} ns per record)."
    ]
    write_result(
        "chains",
        title="Route chains under the causal limits",
        description=__doc__ or "",
        params={"records": args.records, "per_batch": PER_BATCH, "width": WIDTH},
        quick=args.quick,
        comparisons=comparisons,
        tables=[overhead, table],
        notes=notes,
        raw={"samples": got, "ledger": ledger},
    )


if __name__ == "__main__":
    main()
