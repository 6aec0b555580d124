"""Spool: append vs a plain file write, drain vs a direct insert, forward-path cost.

- append: ``Spool.append`` of whole batches then one fsync (``flush()``), vs
  a plain sequential ``os.write`` of the same payload bytes then one fsync,
  same disk, same run (the limit: the spool adds framing, descriptors and a
  checksum); bytes/s of payload.  The spool starts each appended MiB's
  writeback as it goes (``sync_file_range``); a second peer does the same
  in its write loop (what an expert writes: the floor for the spool);
- drain: a spool of batches delivered into chDB by a ``SpoolingSink``
  (``spool="always"``, grouped inserts of up to ``group_bytes``, clock
  stopped when the spool is empty) vs ``ClickHouseSink.insert_now`` of the
  same batches straight from memory in the same groups (the same inserts,
  no disk);
- forward: submit + ``flush()`` + full delivery of the same batches into chDB
  through a ClickHouse sink with default batching, wrapped in a
  ``SpoolingSink`` in modes ``off`` / ``outage`` / ``always`` over a healthy
  destination (records/s; clock stopped when every row is inserted), and
  the same runs' records per CPU-second of the whole process (less
  sensitive than wall time to other processes on shared cores); these
  three run ``--forward-repeat`` interleaved rounds among themselves.

Every run's tables are dropped once it is measured, so chDB's background
merges of one run's parts are not billed to the next.

Targets (issue #12): append >= 0.8x the plain write; ``outage`` costs
nothing measurable while healthy (>= 0.9x ``off``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import trio
from harness import (
    arguments,
    comparison,
    fmt,
    interleave,
    summary,
    target,
    timed_rate,
    write_result,
)

from taproute.native import make_descriptors
from taproute.routing import HookRegistry, Layout, RecordBatch, RecordSchema
from taproute.service.sinks.clickhouse import ChdbTransport, ClickHouseSink
from taproute.service.sinks.spool import Spool, SpoolConfig
from taproute.service.sinks.spool.files import start_writeback
from taproute.service.sinks.spool.log import WRITEBACK_BYTES
from taproute.service.sinks.spool.spooling import SpoolingSink

FLOATS = 256  # 1 KiB payload per record
GROUP_BYTES = 16 << 20  # SpoolingSink's default drain group
SCHEMA = RecordSchema([Layout("act", [("values", "Array(Float32)", (FLOATS,))])])


def make_batches(count: int, per_batch: int) -> list[RecordBatch]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(count):
        payload = rng.standard_normal((per_batch, FLOATS), dtype=np.float32)
        desc = make_descriptors(
            0,
            FLOATS * 4,
            count=per_batch,
            layout_ids=SCHEMA.layout_id("act"),
            keys=np.arange(per_batch),
            seqs=np.arange(i * per_batch, (i + 1) * per_batch),
        )
        out.append(RecordBatch.from_buffer(desc, payload))
    return out


def fresh(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def append_rate(root: Path, batches: Sequence[RecordBatch]) -> float:
    nbytes = sum(b.nbytes for b in batches)
    directory = fresh(root / "append")

    async def body() -> float:
        spool = Spool.open(SpoolConfig(directory=directory))  # opened before the clock starts
        started = time.perf_counter()
        for b in batches:
            await spool.append(b)
        await spool.sync()
        elapsed = time.perf_counter() - started
        await spool.aclose()
        return elapsed

    return nbytes / trio.run(body)


def plain_write_rate(root: Path, batches: Sequence[RecordBatch]) -> float:
    nbytes = sum(b.nbytes for b in batches)
    directory = fresh(root / "plain")

    def body() -> None:
        fd = os.open(directory / "data", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            for b in batches:
                view = memoryview(b.payload)
                while view:
                    view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)

    return timed_rate(nbytes, body)


def expert_write_rate(root: Path, batches: Sequence[RecordBatch]) -> float:
    """Payload bytes/s of ``os.write`` per batch, starting each written MiB's
    writeback as it goes (``sync_file_range``, what the spool does), then
    one fsync: the peer an expert writes, beside the plain one."""
    nbytes = sum(b.nbytes for b in batches)
    directory = fresh(root / "expert")

    def body() -> None:
        fd = os.open(directory / "data", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            written = started = 0
            for b in batches:
                view = memoryview(b.payload)
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
                    written += n
                if written - started >= WRITEBACK_BYTES:
                    start_writeback(fd, started, written - started)
                    started = written
            os.fsync(fd)
        finally:
            os.close(fd)

    return timed_rate(nbytes, body)


#: Records per CPU-second (the whole process: the loop, insert threads, chDB)
#: of each forward run, by mode, in call order (the first call is warm-up).
FORWARD_CPU: dict[str, list[float]] = {}


def forward_rate(
    root: Path, mode: str, batches: Sequence[RecordBatch], make_sink: Callable[[], ClickHouseSink]
) -> float:
    """Records/s (wall) of one forward run; records per CPU-second go to FORWARD_CPU."""
    records = sum(len(b) for b in batches)
    directory = fresh(root / f"fwd-{mode}")
    cpu: list[float] = []

    inner = make_sink()

    async def body() -> float:
        spool = None if mode == "off" else Spool.open(SpoolConfig(directory=directory))
        sink = SpoolingSink("bench", inner, spool, mode=mode)  # type: ignore[arg-type]
        async with trio.open_nursery() as nursery:
            await nursery.start(sink.run)
            started = time.perf_counter()  # from the first submit to every row inserted
            cpu_started = time.process_time()
            for b in batches:
                await sink.submit(b)
            await sink.flush()
            await sink.wait_delivered()
            elapsed = time.perf_counter() - started
            cpu.append(time.process_time() - cpu_started)
            await sink.close()
        assert sum(c.records for c in inner.counters.values()) == records
        return elapsed

    try:
        rate = records / trio.run(body)
    finally:
        drop_tables(inner)
    FORWARD_CPU.setdefault(mode, []).append(records / cpu[0])
    return rate


def drop_tables(sink: ClickHouseSink) -> None:
    """Drop ``sink``'s tables once its run is measured (clock stopped): chDB
    merges a table's parts in the background after its inserts, and that
    work (CPU on the same cores, counted in the process's CPU time) would
    otherwise land in whichever run comes next."""
    for table in sink.tables:
        sink.transport.execute(f"DROP TABLE IF EXISTS `{table}` SYNC")


def groups(batches: Sequence[RecordBatch], group_bytes: int) -> list[list[RecordBatch]]:
    """The batches cut into consecutive groups of up to ``group_bytes`` (as a drain does)."""
    out: list[list[RecordBatch]] = [[]]
    size = 0
    for b in batches:
        if out[-1] and size + b.nbytes > group_bytes:
            out.append([])
            size = 0
        out[-1].append(b)
        size += b.nbytes
    return out


def versus_off(
    what: str, mode: str, measured: Mapping[str, Any], off: Mapping[str, Any], unit: str
) -> dict[str, Any]:
    """The forward path's ``measured`` figures with spool ``mode`` against ``off``'s."""
    healthy = " (healthy)" if mode == "outage" else ""
    return comparison(
        f'{what}: spool="{mode}"{healthy} vs "off"',
        measured,
        off,
        taproute_label=mode,
        peer_label="off",
        unit=unit,
    )


def main() -> None:
    args = arguments(__doc__, batches=(64, 16), per_batch=(1024, 256), forward_repeat=(15, 3))
    root = Path(tempfile.mkdtemp(prefix="taproute-bench-spool-"))
    try:
        batches = make_batches(args.batches, args.per_batch)
        records = args.batches * args.per_batch
        transport = ChdbTransport(root / "chdb")
        hooks = HookRegistry()
        hooks.bind("h", layout="act")
        rounds = {"n": 0}

        def sink() -> ClickHouseSink:
            rounds["n"] += 1
            return ClickHouseSink(
                transport,
                SCHEMA,
                raw=["act"],
                create_tables=True,
                raw_table=f"r{rounds['n']}_{{layout}}",
                hooks=hooks,
                owns_transport=False,
            )

        def drain() -> float:
            directory = fresh(root / "drain")

            async def fill() -> None:
                spool = Spool.open(SpoolConfig(directory=directory))
                for b in batches:
                    await spool.append(b)
                await spool.aclose()

            trio.run(fill)
            inner = sink()

            async def body() -> float:
                spooling = SpoolingSink(
                    "bench",
                    inner,
                    Spool.open(SpoolConfig(directory=directory)),
                    mode="always",
                    group_bytes=GROUP_BYTES,
                )
                async with trio.open_nursery() as nursery:
                    started = time.perf_counter()  # recovery starts draining at run()
                    await nursery.start(spooling.run)
                    await spooling.wait_delivered()
                    elapsed = time.perf_counter() - started
                    await spooling.close()
                return elapsed

            rate = records / trio.run(body)
            assert inner.counters[inner.tables and next(iter(inner.tables))].records == records
            drop_tables(inner)
            return rate

        def direct() -> float:
            inner = sink()

            async def body() -> None:
                for i, group in enumerate(groups(batches, GROUP_BYTES)):
                    await inner.insert_now(group, f"direct-{rounds['n']}-{i}")

            rate = timed_rate(records, lambda: trio.run(body))
            drop_tables(inner)
            return rate

        figures = interleave(
            {
                "append": lambda: append_rate(root, batches),
                "plain_write": lambda: plain_write_rate(root, batches),
                "expert_write": lambda: expert_write_rate(root, batches),
                "drain": drain,
                "direct_insert": direct,
            },
            repeat=args.repeat,
        )
        # A forward run takes a fraction of a second and its ratios moved by
        # tens of percent between single runs: more rounds, among themselves.
        figures.update(
            interleave(
                {
                    "forward_off": lambda: forward_rate(root, "off", batches, sink),
                    "forward_outage": lambda: forward_rate(root, "outage", batches, sink),
                    "forward_always": lambda: forward_rate(root, "always", batches, sink),
                },
                repeat=args.forward_repeat,
            )
        )
        transport.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    append = comparison(
        "spool append vs plain sequential write (+ fsync)",
        figures["append"],
        figures["plain_write"],
        taproute_label="Spool.append",
        peer_label="os.write",
        unit="bytes/s",
    )
    append_expert = comparison(
        "spool append vs sequential write starting each MiB's writeback (+ fsync)",
        figures["append"],
        figures["expert_write"],
        taproute_label="Spool.append",
        peer_label="os.write + sync_file_range",
        unit="bytes/s",
    )
    drain_cmp = comparison(
        "drain from spool into chDB vs direct insert",
        figures["drain"],
        figures["direct_insert"],
        taproute_label="SpoolingSink drain",
        peer_label="insert_now from memory",
        unit="records/s",
    )
    cpu = {mode: summary(samples[1:]) for mode, samples in FORWARD_CPU.items()}  # no warm-up
    off, per_cpu = figures["forward_off"], "records per CPU-second"
    outage = versus_off("forward path", "outage", figures["forward_outage"], off, "records/s")
    always = versus_off("forward path", "always", figures["forward_always"], off, "records/s")
    outage_cpu = versus_off("forward path CPU", "outage", cpu["outage"], cpu["off"], per_cpu)
    always_cpu = versus_off("forward path CPU", "always", cpu["always"], cpu["off"], per_cpu)
    a, o = append["ratio"]["median"], outage["ratio"]["median"]
    oc = outage_cpu["ratio"]["median"]
    write_result(
        "spool",
        title="Spool: append, drain, forward-path cost",
        description=__doc__.split("\n\n")[0],
        params={
            "batches": args.batches,
            "records_per_batch": args.per_batch,
            "payload_bytes_per_record": FLOATS * 4,
            "repeat": args.repeat,
            "forward_repeat": args.forward_repeat,
            "fsync": "once per run (flush)",
            "drain_group_bytes": GROUP_BYTES,
            "forward_destination": "ClickHouseSink on chDB, default Batching",
        },
        quick=args.quick,
        comparisons=[append, append_expert, drain_cmp, outage, always, outage_cpu, always_cpu],
        targets=[
            target("append >= 0.8x plain write", a >= 0.8, f"{fmt(a)}x"),
            target('"outage" >= 0.9x "off" while healthy', o >= 0.9, f"{fmt(o)}x"),
            target(
                '"outage" >= 0.9x "off" while healthy (CPU per record)', oc >= 0.9, f"{fmt(oc)}x"
            ),
        ],
        raw={
            **{name: s["samples"] for name, s in figures.items()},
            **{f"forward_{mode}_cpu": s["samples"] for mode, s in cpu.items()},
        },
    )


if __name__ == "__main__":
    main()
