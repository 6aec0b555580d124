"""Scaling curves: how taproute's throughput moves with each dimension of
the workload, beside a batched numpy peer measured at the same points.

Every destination copies the records' bytes it gets (``CopySink`` /
``Copier``); each point is the median of interleaved repetitions.

- records per batch, 1 ... 4096 (MiniLM token states);
- record size, 64 B ... 96 KiB (64 records per batch);
- routes / destinations: one hook fanned out to N routes, each with its own
  destination (N = 1 ... 8);
- mixed batches: records of H hooks in every batch, one route per hook,
  with and without a predicate that keeps half of each hook's records;
- stateful keys and key skew: the running mean of stateful_vs_bytewax over
  16 ... 4096 distinct keys, uniform and Zipf (s = 1.2), 2 owners, beside
  the bare function;
- producer threads: 1, 2, 4 threads submitting to one runtime, beside a
  ``queue.Queue`` of batches with one consumer thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import stateful_vs_bytewax as sv
from _workload import Copier, CopySink, Dispatch, run_inline, run_thread_queue
from harness import arguments, fmt, interleave, timed_rate, write_result

from taproute.service import (
    Layout,
    RecordSchema,
    Route,
    RoutingConfig,
    RoutingSink,
    create_record_runtime,
    make_descriptors,
)


def layout(floats: int) -> Layout:
    return Layout(f"f{floats}", [("values", "Array(Float32)", (floats,))])


def make(floats: int, per_batch: int, n_batches: int, hooks: int = 1) -> list[tuple]:
    rng = np.random.default_rng(0)
    bufs = [rng.standard_normal(per_batch * floats, dtype=np.float32) for _ in range(4)]
    ids = np.arange(per_batch) % hooks if hooks > 1 else 0
    desc = make_descriptors(
        ids, floats * 4, count=per_batch, layout_ids=0, keys=np.arange(per_batch)
    )
    return [(desc, bufs[i % 4]) for i in range(n_batches)]


def keep_half(desc: np.ndarray) -> np.ndarray:
    return desc["key"] % 2 == 0


def taproute_rate(
    floats: int,
    batches: list[tuple],
    *,
    hooks: int = 1,
    fanout: int = 1,
    predicate: Callable[[np.ndarray], np.ndarray] | None = None,
    producers: int = 1,
) -> float:
    dests = {f"d{h}_{j}": CopySink() for h in range(hooks) for j in range(fanout)}
    routes = [
        Route(f"r{h}_{j}", f"h{h}", f"d{h}_{j}", predicate=predicate)
        for h in range(hooks)
        for j in range(fanout)
    ]
    schema = RecordSchema([layout(floats)])
    router = RoutingSink(RoutingConfig(routes), schema, dests, unmatched="drop")
    n = sum(len(d) for d, _ in batches)
    with create_record_runtime(record_sink=router) as runtime:
        for h in range(hooks):
            assert runtime.bind_hook(f"h{h}", layout=f"f{floats}") == h

        def produce(part: list[tuple]) -> None:
            for desc, payload in part:
                runtime.submit_batch(desc, payload)

        def body() -> None:
            if producers == 1:
                produce(batches)
            else:
                threads = [
                    threading.Thread(target=produce, args=(batches[i::producers],))
                    for i in range(producers)
                ]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            runtime.flush()

        rate = timed_rate(n, body)
    expected = n * fanout // (2 if predicate else 1)
    assert sum(d.records for d in dests.values()) == expected
    return rate


def peer_rate(
    batches: list[tuple],
    *,
    hooks: int = 1,
    fanout: int = 1,
    predicate: Callable[[np.ndarray], np.ndarray] | None = None,
    producers: int = 0,
) -> float:
    """Numpy dispatch inline (``producers == 0``), or behind a
    ``queue.Queue`` of batches fed by ``producers`` threads."""
    copiers = [[Copier() for _ in range(fanout)] for _ in range(hooks)]

    def filtered(copier: Copier) -> Callable[[np.ndarray, Any], None]:
        if predicate is None:
            return copier
        return lambda desc, payload: copier(desc[predicate(desc)], payload)

    dispatch = Dispatch({h: [filtered(c) for c in copiers[h]] for h in range(hooks)})
    n = sum(len(d) for d, _ in batches)
    if producers <= 1:
        runner = run_inline if producers == 0 else run_thread_queue
        return timed_rate(n, lambda: runner(dispatch, batches))
    import queue

    q: queue.Queue[tuple | None] = queue.Queue(maxsize=64)

    def consume() -> None:
        while (item := q.get()) is not None:
            dispatch(*item)

    def produce(part: list[tuple]) -> None:
        for batch in part:
            q.put(batch)

    def body() -> None:
        consumer = threading.Thread(target=consume)
        consumer.start()
        threads = [
            threading.Thread(target=produce, args=(batches[i::producers],))
            for i in range(producers)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        q.put(None)
        consumer.join()

    return timed_rate(n, body)


def curve(
    title: str,
    x_label: str,
    xs: list[Any],
    variants: Callable[[Any], dict[str, Callable[[], float]]],
    repeat: int,
    log_x: bool = False,
) -> tuple[dict[str, Any], dict[str, Any]]:
    series: dict[str, list[float]] = {}
    raw: dict[str, Any] = {}
    for x in xs:
        got = interleave(variants(x), repeat=repeat, warmup=1)
        raw[str(x)] = got
        for name, s in got.items():
            series.setdefault(name, []).append(s["median"])
    return (
        {
            "title": title,
            "x_label": x_label,
            "y_label": "records/s",
            "x": xs,
            "series": series,
            "log_x": log_x,
            "log_y": True,
        },
        raw,
    )


def zipf_keys(n: int, distinct: int, skew: float | None, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if skew is None:
        return rng.integers(0, distinct, n)
    ranks = np.arange(1, distinct + 1, dtype=np.float64)
    p = ranks**-skew
    return rng.choice(distinct, size=n, p=p / p.sum())


def main() -> None:
    args = arguments(__doc__, repeat=(5, 1), mib=(24.0, 3.0))
    mib = args.mib
    curves, raws, notes = [], {}, []

    def batches_for(floats: int, per_batch: int, hooks: int = 1) -> list[tuple]:
        n = max(8, int(mib * 2**20 / (floats * 4 * per_batch)))
        return make(floats, per_batch, min(n, 20_000), hooks)

    # records per batch
    per_batch_xs = [1, 4, 16, 64, 256, 1024, 4096]
    cache: dict[Any, list[tuple]] = {}

    def by_batch(x: int) -> dict[str, Callable[[], float]]:
        cache.clear()
        cache[x] = batches_for(384, x) if x >= 16 else make(384, x, int(4000 * mib / 24) + 50)
        b = cache[x]
        return {
            "taproute forward": lambda: taproute_rate(384, b),
            "numpy dispatch inline": lambda: peer_rate(b),
            "thread + queue.Queue": lambda: peer_rate(b, producers=1),
        }

    c, raw = curve(
        "records per batch (MiniLM token, 1.5 KiB)",
        "records per batch",
        per_batch_xs,
        by_batch,
        args.repeat,
        True,
    )
    curves.append(c)
    raws["records_per_batch"] = raw

    # record size
    def by_size(floats: int) -> dict[str, Callable[[], float]]:
        b = batches_for(floats, 64)
        return {
            "taproute forward": lambda: taproute_rate(floats, b),
            "numpy dispatch inline": lambda: peer_rate(b),
        }

    c, raw = curve(
        "record size (64 records per batch)",
        "float32 per record",
        [16, 96, 384, 768, 3072, 24576],
        by_size,
        args.repeat,
        True,
    )
    curves.append(c)
    raws["record_size"] = raw

    # routes and destinations (fan-out)
    def by_fanout(n: int) -> dict[str, Callable[[], float]]:
        b = batches_for(384, 256)
        return {
            "taproute forward": lambda: taproute_rate(384, b, fanout=n),
            "numpy dispatch inline": lambda: peer_rate(b, fanout=n),
        }

    c, raw = curve(
        "routes: one hook fanned out to N routes / destinations",
        "routes (each its own destination)",
        [1, 2, 4, 8],
        by_fanout,
        args.repeat,
    )
    curves.append(c)
    raws["fanout"] = raw

    # mixed batches, with and without predicates
    def by_hooks(h: int) -> dict[str, Callable[[], float]]:
        b = batches_for(384, 512, hooks=h)
        return {
            "taproute": lambda: taproute_rate(384, b, hooks=h),
            "taproute, predicate keeps 1/2": lambda: taproute_rate(
                384, b, hooks=h, predicate=keep_half
            ),
            "numpy dispatch": lambda: peer_rate(b, hooks=h),
            "numpy dispatch, predicate keeps 1/2": lambda: peer_rate(
                b, hooks=h, predicate=keep_half
            ),
        }

    c, raw = curve(
        "mixed batches: H hooks per batch, one route each (512 records/batch)",
        "hooks per batch",
        [1, 2, 4, 8, 16],
        by_hooks,
        args.repeat,
    )
    curves.append(c)
    raws["mixed_hooks"] = raw

    # keys and skew (stateful)
    n_records = int(mib * 2**20 / (sv.WIDTH * 4))

    def by_keys(spec: str) -> dict[str, Callable[[], float]]:
        distinct, skew = spec.split("/")
        keys = zipf_keys(n_records, int(distinct), None if skew == "uniform" else 1.2)
        values = np.random.default_rng(1).standard_normal((n_records, sv.WIDTH), dtype=np.float32)
        b = [
            (keys[i : i + sv.PER_BATCH], values[i : i + sv.PER_BATCH])
            for i in range(0, n_records, sv.PER_BATCH)
        ]
        return {
            "taproute stateful, 2 owners": lambda: sv.taproute_run(b, 2)[0],
            "taproute stateful, 1 owner": lambda: sv.taproute_run(b, 1)[0],
            "bare function": lambda: sv.bare_run(b)[0],
        }

    key_specs = [f"{k}/{s}" for k in (16, 256, 4096) for s in ("uniform", "zipf1.2")]
    c, raw = curve(
        "stateful running mean: distinct keys / skew (4096 records/batch)",
        "distinct keys / distribution",
        key_specs,
        by_keys,
        args.repeat,
    )
    curves.append(c)
    raws["keys"] = raw

    # producer threads
    def by_producers(p: int) -> dict[str, Callable[[], float]]:
        b = batches_for(384, 256)
        return {
            "taproute forward": lambda: taproute_rate(384, b, producers=p),
            "queue.Queue, one consumer thread": lambda: peer_rate(b, producers=p),
        }

    c, raw = curve(
        "producer threads submitting concurrently (256 records/batch)",
        "producer threads",
        [1, 2, 4],
        by_producers,
        args.repeat,
    )
    curves.append(c)
    raws["producers"] = raw

    for c in curves:
        series = c["series"]
        names = list(series)
        t = names[0]
        peer = next(n for n in names if "taproute" not in n)
        ratios = [a / b for a, b in zip(series[t], series[peer], strict=True)]
        notes.append(
            f"{c['title']}: {t} / {peer} ranges {min(ratios):.2f}x to {max(ratios):.2f}x "
            f"across {c['x_label']} {c['x'][0]} ... {c['x'][-1]} "
            f"(taproute {fmt(min(series[t]))} to {fmt(max(series[t]))} records/s)."
        )
    write_result(
        "scaling",
        title="Scaling curves",
        description=__doc__.split("\n\n")[0],
        params={"mib_per_point": mib, "repeat": args.repeat},
        quick=args.quick,
        curves=curves,
        notes=notes,
        raw=raws,
    )


if __name__ == "__main__":
    main()
