"""Fan-out and routing by hook, against what a competent user writes.

Same records (MiniLM token states, 384 float32), same run, interleaved;
every destination copies the records' bytes it gets:

- fan-out: one hook, three forward routes, every record to each of 3
  destinations (every peer sends every record to all 3 too);
- by hook: each batch mixes records of 8 hooks (as one capture step over 8
  layers would), 8 routes each taking one hook to its own destination.

Peers, each batched: numpy dispatch inline (one grouping pass per batch:
``argsort`` + ``unique`` on output_id), a consumer thread fed a bounded
``queue.Queue`` of batches, an asyncio consumer task fed an
``asyncio.Queue`` of batches, and the bare copies with no dispatch at all
(fan-out only: the floor).
"""

from __future__ import annotations

import numpy as np
from _workload import (
    PEERS,
    Copier,
    CopySink,
    Dispatch,
    descriptors,
    payloads,
    routing_sink,
    schema_for,
)
from harness import arguments, comparison, fmt, interleave, timed_rate, write_result

from taproute.service import create_record_runtime

SHAPE = "minilm_token"
PER_BATCH = 512
HOOKS = 8
FANOUT = 3


def make_batches(n_batches: int, mixed: bool) -> list[tuple]:
    bufs = payloads(SHAPE, PER_BATCH)
    ids = np.arange(PER_BATCH) % HOOKS if mixed else 0
    desc = descriptors(ids, SHAPE, PER_BATCH)
    return [(desc, bufs[i % len(bufs)]) for i in range(n_batches)]


def taproute_rate(batches: list[tuple], mixed: bool) -> float:
    if mixed:
        dests = {f"d{h}": CopySink() for h in range(HOOKS)}
        table = {f"layers.{h}": [f"d{h}"] for h in range(HOOKS)}
    else:
        dests = {f"d{i}": CopySink() for i in range(FANOUT)}
        table = {"layers.*": list(dests)}
    router = routing_sink(schema_for(SHAPE), table, dests)
    n = len(batches) * PER_BATCH
    with create_record_runtime(record_sink=router) as runtime:
        for h in range(HOOKS if mixed else 1):
            assert runtime.bind_hook(f"layers.{h}", layout=SHAPE) == h

        def body() -> None:
            for desc, payload in batches:
                runtime.submit_batch(desc, payload)
            runtime.flush()

        rate = timed_rate(n, body)
    expected = n // HOOKS if mixed else n
    assert all(d.records == expected for d in dests.values())
    return rate


def peer_rate(peer: str, batches: list[tuple], mixed: bool) -> float:
    if mixed:
        copiers = [Copier() for _ in range(HOOKS)]
        dispatch = Dispatch({h: [copiers[h]] for h in range(HOOKS)})
    else:
        copiers = [Copier() for _ in range(FANOUT)]
        dispatch = Dispatch({0: copiers})
    n = len(batches) * PER_BATCH
    rate = timed_rate(n, lambda: PEERS[peer](dispatch, batches))
    expected = n // HOOKS if mixed else n
    assert all(c.records == expected for c in copiers)
    return rate


def bare_rate(batches: list[tuple]) -> float:
    copiers = [Copier() for _ in range(FANOUT)]

    def body() -> None:
        for desc, payload in batches:
            for copier in copiers:
                copier(desc, payload)

    return timed_rate(len(batches) * PER_BATCH, body)


def main() -> None:
    args = arguments(__doc__, repeat=(7, 2), batches=(400, 60))
    comparisons, notes, raw, rows = [], [], {}, []
    for mixed in (False, True):
        batches = make_batches(args.batches, mixed)
        variants = {
            "taproute": lambda b=batches, m=mixed: taproute_rate(b, m),
            **{p: (lambda p=p, b=batches, m=mixed: peer_rate(p, b, m)) for p in PEERS},
        }
        if not mixed:
            variants["bare copies (no dispatch)"] = lambda b=batches: bare_rate(b)
        got = interleave(variants, repeat=args.repeat)
        case = (
            f"by hook: {HOOKS} hooks mixed in each batch, {HOOKS} routes"
            if mixed
            else f"fan-out: every record to {FANOUT} destinations"
        )
        raw["by_hook" if mixed else "fanout"] = got
        for peer in variants:
            if peer != "taproute":
                comparisons.append(
                    comparison(
                        f"{case} ({PER_BATCH} MiniLM token records/batch)",
                        got["taproute"],
                        got[peer],
                        taproute_label="taproute",
                        peer_label=peer,
                        unit="records/s",
                    )
                )
        rows += [[case, name, s["median"], s["min"], s["max"]] for name, s in got.items()]
        best = max((p for p in variants if p != "taproute"), key=lambda p: got[p]["median"])
        notes.append(
            f"{case}: taproute {fmt(got['taproute']['median'])} records/s; the fastest "
            f"alternative ({best}) {fmt(got[best]['median'])}: taproute/it "
            f"{got['taproute']['median'] / got[best]['median']:.2f}x."
        )
    write_result(
        "fanout_peers",
        title="Fan-out and routing by hook",
        description=__doc__.split("\n\n")[0],
        params={
            "shape": SHAPE,
            "records_per_batch": PER_BATCH,
            "hooks": HOOKS,
            "fanout": FANOUT,
            "batches": args.batches,
            "repeat": args.repeat,
        },
        quick=args.quick,
        comparisons=comparisons,
        tables=[
            {
                "title": "Records/s",
                "columns": ["case", "variant", "median", "min", "max"],
                "rows": rows,
            }
        ],
        notes=notes,
        raw=raw,
    )


if __name__ == "__main__":
    main()
