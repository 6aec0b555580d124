"""Routing throughput: taproute vs a plain-Python per-record dispatch loop.

Same run, same records (1 KiB each, 1024 per batch):

- forward: one forward route into a null destination, through the threaded
  runtime (producer thread -> ingress -> record worker -> destination actor);
- plain loop: for each record, look its output_id up in a dict and hand the
  record's bytes to the same kind of null sink;
- fan-out: the same hook feeding three forward routes (3 destinations);
- single submit: one ``runtime.submit`` per record (coalesced at ingress);
- allocation: tracemalloc peak while forwarding 1 GiB, as a share of it.

Targets (issue #2): forward >= 2 M records/s and >= 3x the plain loop;
fan-out >= 0.7x one route; single submit >= 250 k records/s; < 1% of the
forwarded bytes allocated.
"""

from __future__ import annotations

import argparse
import tracemalloc

import numpy as np
from harness import NullSink, measure, report, timed_rate

from taproute.actors import RoutingSink
from taproute.native import make_descriptors
from taproute.routing import Layout, RecordSchema, Route, RoutingConfig
from taproute.service import create_record_runtime

RECORD = 1024
PER_BATCH = 1024
SCHEMA = RecordSchema([Layout("kib", [("bytes", "Array(UInt8)", (RECORD,))])])


class PlainNullSink:
    """The plain loop's sink: same job, one record at a time."""

    def __init__(self) -> None:
        self.records = 0

    def submit(self, record: memoryview) -> None:
        self.records += 1


def make_batches(n_batches: int, output_id: int) -> list[tuple[np.ndarray, np.ndarray]]:
    buffers = [
        np.random.default_rng(i).integers(0, 255, RECORD * PER_BATCH, dtype=np.uint8)
        for i in range(8)
    ]
    desc = make_descriptors(output_id, RECORD, count=PER_BATCH, layout_ids=0)
    return [(desc, buffers[i % len(buffers)]) for i in range(n_batches)]


def forward_rate(n_batches: int, n_routes: int) -> float:
    sinks = {f"d{i}": NullSink() for i in range(n_routes)}
    routes = [Route(f"r{i}", "layers.*.q", f"d{i}") for i in range(n_routes)]
    sink = RoutingSink(RoutingConfig(routes), SCHEMA, sinks, unmatched="drop")
    with create_record_runtime(record_sink=sink) as runtime:
        q = runtime.bind_hook("layers.0.q", layout="kib")
        batches = make_batches(n_batches, q)

        def body() -> None:
            for desc, payload in batches:
                runtime.submit_batch(desc, payload)
            runtime.flush()

        rate = timed_rate(n_batches * PER_BATCH, body)
    assert all(s.records == n_batches * PER_BATCH for s in sinks.values())
    return rate


def plain_loop_rate(n_batches: int) -> float:
    sink = PlainNullSink()
    table = {0: sink}
    batches = make_batches(n_batches, 0)

    def body() -> None:
        for desc, payload in batches:
            view = memoryview(payload)
            ids = desc["output_id"].tolist()
            offsets = desc["offset"].tolist()
            lengths = desc["length"].tolist()
            for oid, off, length in zip(ids, offsets, lengths, strict=True):
                table[oid].submit(view[off : off + length])

    rate = timed_rate(n_batches * PER_BATCH, body)
    assert sink.records == n_batches * PER_BATCH
    return rate


def single_submit_rate(n_records: int) -> float:
    null = NullSink()
    sink = RoutingSink(
        RoutingConfig([Route("r", "layers.*.q", "d")]), SCHEMA, {"d": null}, unmatched="drop"
    )
    payload = bytes(RECORD)
    with create_record_runtime(record_sink=sink) as runtime:
        q = runtime.bind_hook("layers.0.q", layout="kib")

        def body() -> None:
            submit = runtime.submit
            for _ in range(n_records):
                submit(q, payload)
            runtime.flush()

        rate = timed_rate(n_records, body)
    assert null.records == n_records
    return rate


def allocated_share(gib: float) -> dict[str, float]:
    n_batches = int(gib * 2**30 / (RECORD * PER_BATCH))
    null = NullSink()
    sink = RoutingSink(
        RoutingConfig([Route("r", "layers.*.q", "d")]), SCHEMA, {"d": null}, unmatched="drop"
    )
    with create_record_runtime(record_sink=sink) as runtime:
        q = runtime.bind_hook("layers.0.q", layout="kib")
        batches = make_batches(n_batches, q)
        runtime.submit_batch(*batches[0])  # warm every code path before tracing
        runtime.flush()
        tracemalloc.start()
        tracemalloc.reset_peak()
        for desc, payload in batches:
            runtime.submit_batch(desc, payload)
        runtime.flush()
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    forwarded = n_batches * RECORD * PER_BATCH
    return {"forwarded_bytes": forwarded, "peak_traced_bytes": peak, "share": peak / forwarded}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, default=400)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--gib", type=float, default=1.0)
    args = parser.parse_args()

    forward = measure(lambda: forward_rate(args.batches, 1), repeat=args.repeat)
    fanout = measure(lambda: forward_rate(args.batches, 3), repeat=args.repeat)
    plain = measure(lambda: plain_loop_rate(args.batches // 4), repeat=args.repeat)
    single = measure(lambda: single_submit_rate(200_000), repeat=args.repeat)
    alloc = allocated_share(args.gib)
    ratios = {
        "forward_vs_plain_loop": forward["median"] / plain["median"],
        "fanout3_vs_forward": fanout["median"] / forward["median"],
    }
    targets = {
        "forward_records_per_s>=2e6": forward["median"] >= 2e6,
        "forward_vs_plain_loop>=3": ratios["forward_vs_plain_loop"] >= 3,
        "fanout3_vs_forward>=0.7": ratios["fanout3_vs_forward"] >= 0.7,
        "single_submit_records_per_s>=2.5e5": single["median"] >= 2.5e5,
        "allocated_share<0.01": alloc["share"] < 0.01,
    }
    report(
        "route_throughput",
        {
            "record_bytes": RECORD,
            "records_per_batch": PER_BATCH,
            "peer": "plain-Python loop: dict lookup per record into the same kind of null sink",
            "forward_records_per_s": forward,
            "fanout3_records_per_s": fanout,
            "plain_loop_records_per_s": plain,
            "single_submit_records_per_s": single,
            "ratios": ratios,
            "allocation": alloc,
            "targets_met": targets,
        },
    )


if __name__ == "__main__":
    main()
