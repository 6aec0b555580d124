"""Routing throughput, one forward route into a destination that copies
every record's bytes, against what a competent user writes instead.

Same records, same run, repetitions interleaved, for several record shapes
(MiniLM / GPT-2 token states, a 64-token MiniLM sequence, 1 KiB blobs):

- taproute: ``submit_batch`` per batch from the producer thread, forward
  route, ``CopySink``; the clock stops when ``flush()`` returns;
- bare copy: the destination's copy called directly per batch, no routing
  and no thread: the floor for any router's overhead;
- numpy dispatch inline: a table output_id -> destinations, one numpy
  grouping per batch, in the producer thread;
- thread + ``queue.Queue`` of batches (bounded), consumer dispatching;
- asyncio: a consumer task fed a bounded ``asyncio.Queue`` of batches.

Also: taproute into a destination that never reads (the router's floor),
single-record ``submit`` (coalesced at ingress), and Python-heap bytes
allocated per batch at two payload sizes (a forward route copies nothing,
so it should not grow with the payload).
"""

from __future__ import annotations

import tracemalloc

from _workload import (
    PEERS,
    SHAPES,
    Copier,
    CopySink,
    Dispatch,
    descriptors,
    payloads,
    routing_sink,
    schema_for,
)
from harness import (
    NullSink,
    arguments,
    comparison,
    fmt,
    interleave,
    target,
    timed_rate,
    write_result,
)

from taproute.service import create_record_runtime

#: (shape, records per batch)
CASES = [("minilm_token", 256), ("gpt2_token", 256), ("minilm_seq64", 16), ("blob_1KiB", 1024)]


def batches_for(shape: str, per_batch: int, mib: float) -> list[tuple]:
    record = SHAPES[shape][0] * 4
    n = max(8, int(mib * 2**20 / (record * per_batch)))
    bufs = payloads(shape, per_batch)
    desc = descriptors(0, shape, per_batch)
    return [(desc, bufs[i % len(bufs)]) for i in range(n)]


def taproute_rate(shape: str, batches: list[tuple], sink_kind: str = "copy") -> float:
    dest = CopySink() if sink_kind == "copy" else NullSink()
    router = routing_sink(schema_for(shape), {"layers.*": ["d"]}, {"d": dest})
    n = sum(len(d) for d, _ in batches)
    with create_record_runtime(record_sink=router) as runtime:
        assert runtime.bind_hook("layers.0", layout=shape) == 0

        def body() -> None:
            for desc, payload in batches:
                runtime.submit_batch(desc, payload)
            runtime.flush()

        rate = timed_rate(n, body)
    assert dest.records == n, (dest.records, n)
    return rate


def peer_rate(peer: str, batches: list[tuple]) -> float:
    copier = Copier()
    dispatch = Dispatch({0: [copier]})
    n = sum(len(d) for d, _ in batches)
    rate = timed_rate(n, lambda: PEERS[peer](dispatch, batches))
    assert copier.records == n
    return rate


def bare_rate(batches: list[tuple]) -> float:
    copier = Copier()
    n = sum(len(d) for d, _ in batches)

    def body() -> None:
        for desc, payload in batches:
            copier(desc, payload)

    return timed_rate(n, body)


def single_submit_rate(n_records: int) -> float:
    dest = CopySink()
    router = routing_sink(schema_for("minilm_token"), {"layers.*": ["d"]}, {"d": dest})
    payload = payloads("minilm_token", 1)[0].tobytes()
    with create_record_runtime(record_sink=router) as runtime:
        q = runtime.bind_hook("layers.0", layout="minilm_token")

        def body() -> None:
            submit = runtime.submit
            for _ in range(n_records):
                submit(q, payload)
            runtime.flush()

        rate = timed_rate(n_records, body)
    assert dest.records == n_records
    return rate


def allocated_per_batch(shape: str, per_batch: int, n_batches: int) -> dict[str, float]:
    """Peak Python-heap growth (tracemalloc, numpy buffers included) while
    forwarding ``n_batches`` batches, against one batch's payload size."""
    dest = NullSink()
    router = routing_sink(schema_for(shape), {"layers.*": ["d"]}, {"d": dest})
    bufs = payloads(shape, per_batch, distinct=2)
    desc = descriptors(0, shape, per_batch)
    with create_record_runtime(record_sink=router) as runtime:
        runtime.bind_hook("layers.0", layout=shape)
        runtime.submit_batch(desc, bufs[0])  # warm every code path before tracing
        runtime.flush()
        tracemalloc.start()
        base, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        for i in range(n_batches):
            runtime.submit_batch(desc, bufs[i % 2])
        runtime.flush()
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    batch_bytes = per_batch * SHAPES[shape][0] * 4
    return {
        "batch_payload_bytes": batch_bytes,
        "peak_growth_bytes": peak - base,
        "peak_growth_per_payload_byte_of_one_batch": (peak - base) / batch_bytes,
    }


def main() -> None:
    args = arguments(__doc__, repeat=(7, 2), mib=(96.0, 12.0), singles=(200_000, 30_000))
    comparisons, rows, raw = [], [], {}
    notes = []
    for shape, per_batch in CASES:
        batches = batches_for(shape, per_batch, args.mib)
        variants = {
            "taproute": lambda s=shape, b=batches: taproute_rate(s, b),
            "taproute, null destination": lambda s=shape, b=batches: taproute_rate(s, b, "null"),
            "bare copy (no router)": lambda b=batches: bare_rate(b),
            **{peer: (lambda p=peer, b=batches: peer_rate(p, b)) for peer in PEERS},
        }
        got = interleave(variants, repeat=args.repeat)
        raw[shape] = got
        label = f"{SHAPES[shape][1]}, {per_batch}/batch"
        for peer in ("bare copy (no router)", *PEERS):
            comparisons.append(
                comparison(
                    f"forward route, {label}",
                    got["taproute"],
                    got[peer],
                    taproute_label="taproute",
                    peer_label=peer,
                    unit="records/s",
                )
            )
        record_bytes = SHAPES[shape][0] * 4
        rows.append(
            [shape, per_batch]
            + [got[v]["median"] for v in variants]
            + [got["taproute"]["median"] * record_bytes / 1e9]
        )
        best_peer = max(PEERS, key=lambda p: got[p]["median"])
        notes.append(
            f"{label}: taproute {fmt(got['taproute']['median'])} records/s "
            f"({fmt(got['taproute']['median'] * record_bytes / 1e9)} GB/s copied), "
            f"{got['taproute']['median'] / got['bare copy (no router)']['median']:.2f}x the bare "
            f"copy; the best peer ({best_peer}) {fmt(got[best_peer]['median'])} records/s, "
            f"taproute/peer {got['taproute']['median'] / got[best_peer]['median']:.2f}x."
        )
    single = interleave(
        {"single submit": lambda: single_submit_rate(args.singles)}, repeat=args.repeat
    )["single submit"]
    alloc = {
        shape: allocated_per_batch(shape, per, 64 if args.quick else 256)
        for shape, per in (("blob_1KiB", 64), ("minilm_seq64", 16))
    }
    raw["single_submit"] = single
    raw["allocation"] = alloc
    tables = [
        {
            "title": "Records/s by shape (medians)",
            "columns": ["shape", "records/batch", *variants, "taproute GB/s copied"],
            "rows": rows,
        },
        {
            "title": "Single-record submit (coalesced at ingress) and heap growth per batch",
            "columns": ["figure", "value"],
            "rows": [
                ["single submit, MiniLM token records/s (median)", single["median"]],
                *[
                    [
                        f"peak heap growth forwarding {shape} "
                        f"({a['batch_payload_bytes']:,} B/batch)",
                        f"{a['peak_growth_bytes']:,} B",
                    ]
                    for shape, a in alloc.items()
                ],
            ],
        },
    ]
    small, large = alloc["blob_1KiB"], alloc["minilm_seq64"]
    notes.append(
        f"Heap growth while forwarding: {small['peak_growth_bytes']:,} B with "
        f"{small['batch_payload_bytes']:,} B batches, {large['peak_growth_bytes']:,} B with "
        f"{large['batch_payload_bytes']:,} B batches "
        f"({large['batch_payload_bytes'] // small['batch_payload_bytes']}x larger)."
    )
    targets = [
        target(
            "heap growth independent of payload size (<= 2x for a 24x larger payload)",
            large["peak_growth_bytes"] <= 2 * max(small["peak_growth_bytes"], 1),
            f"{small['peak_growth_bytes']:,} B vs {large['peak_growth_bytes']:,} B",
        )
    ]
    write_result(
        "route_throughput",
        title="Routing throughput, one forward route",
        description=__doc__.split("\n\n")[0],
        params={
            "cases": CASES,
            "mib_per_run": args.mib,
            "repeat": args.repeat,
            "single_records": args.singles,
        },
        quick=args.quick,
        comparisons=comparisons,
        tables=tables,
        targets=targets,
        notes=notes,
        raw=raw,
    )


if __name__ == "__main__":
    main()
