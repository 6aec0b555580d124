"""Routing with fan-out against what users would otherwise write, and the
physical limit.

Same records (1 KiB each, 1024 per batch), same run, each record going to 3
null destinations:

- taproute: 3 forward routes on one hook, through the threaded runtime;
- dict loop: for each record, a dict lookup and a call per destination;
- asyncio queues: a producer puts each record on 3 ``asyncio.Queue``s,
  one consumer task per destination;
- memcpy: ``np.copyto`` of the same payload bytes (the bandwidth a copying
  router could not beat); taproute's effective GB/s is reported as a
  fraction of it (it copies nothing, so it can exceed 1).

Target (issue #6): taproute >= 3x both peers.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np
from harness import measure, profile_top, report, targets_report
from route_throughput import PER_BATCH, RECORD, forward_rate, make_batches

DESTINATIONS = 3


def dict_loop_rate(n_batches: int) -> float:
    counts = [0] * DESTINATIONS

    def sink(i: int):
        def submit(record: memoryview) -> None:
            counts[i] += 1

        return submit

    table = {0: [sink(i) for i in range(DESTINATIONS)]}
    batches = make_batches(n_batches, 0)
    started = time.perf_counter()
    for desc, payload in batches:
        view = memoryview(payload)
        for oid, off, length in zip(
            desc["output_id"].tolist(),
            desc["offset"].tolist(),
            desc["length"].tolist(),
            strict=True,
        ):
            record = view[off : off + length]
            for submit in table[oid]:
                submit(record)
    elapsed = time.perf_counter() - started
    assert counts == [n_batches * PER_BATCH] * DESTINATIONS
    return n_batches * PER_BATCH / elapsed


def asyncio_rate(n_batches: int) -> float:
    batches = make_batches(n_batches, 0)

    async def main() -> float:
        queues = [asyncio.Queue(maxsize=4096) for _ in range(DESTINATIONS)]
        counts = [0] * DESTINATIONS

        async def consume(i: int) -> None:
            queue = queues[i]
            while True:
                record = await queue.get()
                if record is None:
                    return
                counts[i] += 1

        consumers = [asyncio.create_task(consume(i)) for i in range(DESTINATIONS)]
        started = time.perf_counter()
        for desc, payload in batches:
            view = memoryview(payload)
            for off, length in zip(desc["offset"].tolist(), desc["length"].tolist(), strict=True):
                record = view[off : off + length]
                for queue in queues:
                    await queue.put(record)
        for queue in queues:
            await queue.put(None)
        await asyncio.gather(*consumers)
        elapsed = time.perf_counter() - started
        assert counts == [n_batches * PER_BATCH] * DESTINATIONS
        return n_batches * PER_BATCH / elapsed

    return asyncio.run(main())


def memcpy_gbps(n_batches: int) -> float:
    batches = make_batches(n_batches, 0)
    target = np.empty_like(batches[0][1])
    started = time.perf_counter()
    for _, payload in batches:
        np.copyto(target, payload)
    return n_batches * RECORD * PER_BATCH / (time.perf_counter() - started) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, default=400)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    taproute = measure(lambda: forward_rate(args.batches, DESTINATIONS), repeat=args.repeat)
    dict_loop = measure(lambda: dict_loop_rate(args.batches // 8), repeat=args.repeat)
    queues = measure(lambda: asyncio_rate(args.batches // 32), repeat=args.repeat)
    memcpy = measure(lambda: memcpy_gbps(args.batches), repeat=args.repeat)
    taproute_gbps = taproute["median"] * RECORD / 1e9
    ratios = {
        "taproute_vs_dict_loop": taproute["median"] / dict_loop["median"],
        "taproute_vs_asyncio_queues": taproute["median"] / queues["median"],
        "taproute_GBps_vs_memcpy": taproute_gbps / memcpy["median"],
    }
    targets = {
        "taproute_vs_dict_loop>=3": ratios["taproute_vs_dict_loop"] >= 3,
        "taproute_vs_asyncio_queues>=3": ratios["taproute_vs_asyncio_queues"] >= 3,
    }
    figures = {
        "record_bytes": RECORD,
        "records_per_batch": PER_BATCH,
        "destinations": DESTINATIONS,
        "peer": "dict-dispatch loop and asyncio-queue fan-out, same records; memcpy of the bytes",
        "taproute_records_per_s": taproute,
        "dict_loop_records_per_s": dict_loop,
        "asyncio_queues_records_per_s": queues,
        "memcpy_GBps": memcpy,
        "taproute_effective_GBps": taproute_gbps,
        "ratios": ratios,
        "targets": targets_report(targets),
    }
    if not all(targets.values()):
        figures["profile"] = profile_top(lambda: forward_rate(args.batches, DESTINATIONS))
    report("fanout_peers", figures)


if __name__ == "__main__":
    main()
