"""Keyed stateful aggregation: taproute stateful route vs Bytewax ``stateful_map``.

Same records, same run: 4096 keys, each record a 64-float vector; every
engine keeps the running mean per key.  Bytewax runs in-process with its
testing source and sink (one record per item, as its API takes them);
taproute gets the records as batches through the threaded runtime into a
stateful route with 2 owner actors.  Outputs differ in granularity (Bytewax
emits the mean after every record; taproute one row per key per batch); the
final means are checked equal.  Target (issue #6): taproute >= 10x Bytewax.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from harness import measure, profile_top, report, targets_report

from taproute.actors import RoutingSink
from taproute.native import StateRegion, make_descriptors, scatter_add
from taproute.routing import (
    Layout,
    Records,
    RecordSchema,
    Route,
    RoutingConfig,
    SlotSpec,
    stateful_processor,
)
from taproute.service import CaptureSink, create_record_runtime

KEYS = 4096
WIDTH = 64
PER_BATCH = 4096
VEC = Layout("vec", [("values", "Array(Float32)", (WIDTH,))])
MEAN = Layout("mean", [("key", "Int64"), ("mean", "Array(Float64)", (WIDTH,))])
SCHEMA = RecordSchema([VEC, MEAN])


@stateful_processor(
    "bench.running_mean",
    key_range=KEYS,
    slot=SlotSpec((WIDTH + 1,), "float64"),  # sum of vectors, then count
    input="vec",
    output="mean",
)
def running_mean(records: Records, keys: np.ndarray, state: StateRegion) -> np.ndarray:
    values = np.ascontiguousarray(records.rows()["values"])
    scatter_add(state.slots[:, :WIDTH], keys, values)  # in order, GIL released
    state.slots[:, WIDTH] += np.bincount(keys, minlength=KEYS)
    touched = np.unique(keys)
    rows = np.empty(len(touched), dtype=MEAN.dtype)
    rows["key"] = touched
    rows["mean"] = state.slots[touched, :WIDTH] / state.slots[touched, WIDTH : WIDTH + 1]
    return rows


def make_data(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    keys = rng.integers(0, KEYS, n)
    values = rng.standard_normal((n, WIDTH), dtype=np.float32)
    return keys, values


def taproute_rate(keys: np.ndarray, values: np.ndarray) -> tuple[float, np.ndarray]:
    out = CaptureSink()
    sink = RoutingSink(
        RoutingConfig(
            [Route("mean", "*", "out", mode="stateful", processor="bench.running_mean", workers=2)]
        ),
        SCHEMA,
        {"out": out},
        unmatched="drop",
    )
    n = len(keys)
    with create_record_runtime(record_sink=sink) as runtime:
        h = runtime.bind_hook("vectors", layout="vec")
        batches = [
            (
                make_descriptors(
                    h,
                    WIDTH * 4,
                    count=len(keys[i : i + PER_BATCH]),
                    layout_ids=0,
                    keys=keys[i : i + PER_BATCH],
                ),
                values[i : i + PER_BATCH],
            )
            for i in range(0, n, PER_BATCH)
        ]
        started = time.perf_counter()
        for desc, payload in batches:
            runtime.submit_batch(desc, payload)
        runtime.flush()
        elapsed = time.perf_counter() - started
    rows = out.rows("mean")
    final = np.zeros((KEYS, WIDTH))
    final[rows["key"]] = rows["mean"]  # later rows overwrite earlier ones
    return n / elapsed, final


def bytewax_rate(keys: np.ndarray, values: np.ndarray) -> tuple[float, np.ndarray]:
    import bytewax.operators as op
    from bytewax.dataflow import Dataflow
    from bytewax.testing import TestingSink, TestingSource, run_main

    items = [(str(k), v) for k, v in zip(keys.tolist(), values, strict=True)]
    out: list = []

    def mean(state, value):
        if state is None:
            state = (np.zeros(WIDTH), 0)
        total, count = state
        total = total + value
        count += 1
        return (total, count), total / count

    flow = Dataflow("running_mean")
    stream = op.input("in", flow, TestingSource(items))
    means = op.stateful_map("mean", stream, mean)
    op.output("out", means, TestingSink(out))
    started = time.perf_counter()
    run_main(flow)
    elapsed = time.perf_counter() - started
    final = np.zeros((KEYS, WIDTH))
    for key, value in out:
        final[int(key)] = value
    return len(items) / elapsed, final


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--bytewax-records", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    keys, values = make_data(args.records)
    bkeys, bvalues = keys[: args.bytewax_records], values[: args.bytewax_records]
    # Same data, checked: both engines end with the same means.
    _, ours = taproute_rate(bkeys, bvalues)
    _, theirs = bytewax_rate(bkeys, bvalues)
    touched = np.unique(bkeys)
    assert np.allclose(ours[touched], theirs[touched], atol=1e-5), "engines disagree"
    taproute = measure(lambda: taproute_rate(keys, values)[0], repeat=args.repeat)
    bytewax = measure(lambda: bytewax_rate(bkeys, bvalues)[0], repeat=args.repeat)
    ratio = taproute["median"] / bytewax["median"]
    targets = {"taproute_vs_bytewax>=10": ratio >= 10}
    figures = {
        "keys": KEYS,
        "vector_floats": WIDTH,
        "peer": "Bytewax stateful_map, in-process, TestingSource/TestingSink",
        "taproute_records_per_s": taproute,
        "bytewax_records_per_s": bytewax,
        "ratios": {"taproute_vs_bytewax": ratio},
        "targets": targets_report(targets),
    }
    if not all(targets.values()):
        figures["profile"] = profile_top(lambda: taproute_rate(keys, values))
    report("stateful_vs_bytewax", figures)


if __name__ == "__main__":
    main()
