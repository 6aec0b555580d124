"""Scaling: records/s against the number of stateless workers and stateful
owners (1, 2, 4), with a processor whose numpy work releases the GIL.

On a 2-core machine the curve should rise from 1 to 2 and flatten after:
the report shows where.  The processor does a fixed amount of elementwise
numpy work per record (GIL released inside each ufunc).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from harness import NullSink, measure, report, targets_report

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
    stateless_processor,
)
from taproute.service import create_record_runtime

FLOATS = 256
PER_BATCH = 1024
KEYS = 64
VEC = Layout("vec", [("values", "Array(Float32)", (FLOATS,))])
OUT = Layout("out", [("value", "Float32")])
SCHEMA = RecordSchema([VEC, OUT])
ROUNDS = 12


def work(values: np.ndarray) -> np.ndarray:
    x = np.array(values, dtype=np.float32)
    for _ in range(ROUNDS):  # each ufunc call releases the GIL over the whole batch
        np.sin(x, out=x)
        np.sqrt(np.abs(x, out=x), out=x)
    return x


@stateless_processor("bench.scale_stateless", input="vec", output="out")
def scale_stateless(records: Records) -> np.ndarray:
    x = work(records.rows()["values"])
    rows = np.empty(len(records), dtype=OUT.dtype)
    rows["value"] = x[:, 0]
    return rows


@stateful_processor(
    "bench.scale_stateful",
    key=lambda d: d["key"] % KEYS,
    key_range=KEYS,
    slot=SlotSpec((FLOATS,), "float64"),
    input="vec",
    output="out",
)
def scale_stateful(records: Records, keys: np.ndarray, state: StateRegion) -> None:
    x = work(records.rows()["values"])
    scatter_add(state.slots, keys, x)


def rate(mode: str, workers: int, batches: int) -> float:
    processor = "bench.scale_stateless" if mode == "stateless" else "bench.scale_stateful"
    router = RoutingSink(
        RoutingConfig([Route("r", "*", "d", mode=mode, processor=processor, workers=workers)]),
        SCHEMA,
        {"d": NullSink()},
        unmatched="drop",
    )
    payload = np.random.default_rng(0).standard_normal(PER_BATCH * FLOATS, dtype=np.float32)
    with create_record_runtime(record_sink=router) as runtime:
        h = runtime.bind_hook("layers.0", layout="vec")
        desc = make_descriptors(
            h, FLOATS * 4, count=PER_BATCH, layout_ids=0, keys=np.arange(PER_BATCH)
        )
        started = time.perf_counter()
        for _ in range(batches):
            runtime.submit_batch(desc, payload)
        runtime.flush()
        elapsed = time.perf_counter() - started
        processed = runtime.counters().routes["r"].processed
    assert processed == batches * PER_BATCH
    return processed / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, default=120)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    curves: dict[str, dict[str, float]] = {}
    for mode in ("stateless", "stateful"):
        curves[mode] = {
            str(n): measure(lambda m=mode, n=n: rate(m, n, args.batches), repeat=args.repeat)[
                "median"
            ]
            for n in (1, 2, 4)
        }
    speedup = {mode: {n: v / c["1"] for n, v in c.items()} for mode, c in curves.items()}
    targets = {f"{mode}_2_workers_faster_than_1": s["2"] > 1.2 for mode, s in speedup.items()}
    report(
        "scaling",
        {
            "cpu_count": os.cpu_count(),
            "records_per_batch": PER_BATCH,
            "peer": "the same route with 1 worker / owner",
            "records_per_s": curves,
            "speedup_vs_1": speedup,
            "targets": targets_report(targets),
        },
    )


if __name__ == "__main__":
    main()
