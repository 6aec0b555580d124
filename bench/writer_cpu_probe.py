"""Where the CPU of a chDB destination goes, per thread, in the model process
and in the writer process (a probe, not part of the suite).

    python bench/writer_cpu_probe.py process   # WriterProcessSink
    python bench/writer_cpu_probe.py thread    # ClickHouseSink in-process

GPT-2 (4 layers x 256, batch 8 x 64 with half the rows padded to half length,
12 hooks, torch on 1 thread), every hook's output routed raw to chDB; rounds of
5 forward passes + ``flush()``.  CPU seconds come from ``/proc`` (user +
system, 10 ms ticks), so a loaded machine's waits are not counted as work:
per round for the model thread, the model process's other threads and the
writer process, and for the rounds together by thread name (chDB's own
threads: ``ThreadPool`` inserts, ``MergeMutate`` merges; ``Trio thread N``
the sink's insert threads: Arrow build and ``Connection.query``), and per
thread name while ``flush()`` runs (from ``schedstat``, nanoseconds): what
the time until flush returns is made of once the model is done.  The output
is printed; keep it under ``bench/profiles/`` with the commit.
"""

from __future__ import annotations

import collections
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from inference_cost import SCHEMA, gpt2

from taproute.service import ClickHouseSink, create_record_runtime
from taproute.service.capture import bind_modules, capture_context
from taproute.service.sinks.writer import WriterProcessSink

TICK = os.sysconf("SC_CLK_TCK")


def cpu(pid: int, tid: str | None = None) -> float:
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def by_thread(pid: int) -> dict[str, tuple[str, float]]:
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            out[tid] = (name, cpu(pid, tid))
        except OSError:
            pass
    return out


def on_cpu(pid: int) -> dict[str, tuple[str, float]]:
    """Per thread id: its name and seconds on CPU (``schedstat``: nanoseconds,
    where ``stat`` counts 10 ms ticks, too coarse for a flush of tens of ms)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            ns = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except OSError:
            continue
        out[tid] = (name, ns / 1e9)
    return out


def spent_by_name(
    before: dict[str, tuple[str, float]], after: dict[str, tuple[str, float]]
) -> collections.Counter[str]:
    """CPU seconds between two :func:`on_cpu` readings, per thread name at the
    end (chDB renames pool threads while they run a query, so names are
    compared per thread id, never summed per name first)."""
    spent: collections.Counter[str] = collections.Counter()
    for tid, (name, seconds) in after.items():
        spent[name] += seconds - before.get(tid, (name, 0.0))[1]
    return spent


def watch_blocks(sink: ClickHouseSink) -> list[tuple[float, float, float, float]]:
    """Record each block of ``sink`` (in-process) as (sealed, insert began,
    insert ended, MB), by wrapping this instance's seal and insert."""
    blocks: list[tuple[float, float, float, float]] = []
    sealed: dict[int, float] = {}
    seal, insert = sink._seal, sink._insert_blocking

    def timed_seal(table: str) -> None:
        if sink._buffers[table].items:
            sealed[id(sink._buffers[table])] = time.perf_counter()
        seal(table)

    def timed_insert(table: str, buffer: Any, token: str) -> None:
        began = time.perf_counter()
        insert(table, buffer, token)
        at = sealed.pop(id(buffer), began)
        blocks.append((at, began, time.perf_counter(), buffer.bytes / 1e6))

    sink._seal = timed_seal  # type: ignore[method-assign]
    sink._insert_blocking = timed_insert  # type: ignore[method-assign]
    return blocks


def timeline(
    blocks: list[tuple[float, float, float, float]], began: float, forwarded: float, end: float
) -> str:
    """One round's blocks in ms from its start: sealed, insert began-ended."""

    def ms(t: float) -> str:
        return f"{(t - began) * 1e3:.0f}"

    shown = " ".join(
        f"[{mb:.1f} MB sealed@{ms(s)} insert {ms(b)}-{ms(e)}]" for s, b, e, mb in sorted(blocks)
    )
    return f"forward ended @{ms(forwarded)}, flush returned @{ms(end)} ms: {shown}"


def main() -> None:
    kind = sys.argv[1] if len(sys.argv) > 1 else "process"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    torch.set_num_threads(1)
    model, patterns, forward = gpt2(4, 256)
    ids = torch.randint(3, 1000, (8, 64))
    mask = torch.ones(8, 64, dtype=torch.long)
    mask[::2, 32:] = 0
    keys = list(range(8))
    me = os.getpid()
    model_tid = str(threading.get_native_id())
    with tempfile.TemporaryDirectory() as data:
        sink: Any
        if kind == "process":
            sink = WriterProcessSink.embedded(SCHEMA, f"{data}/x", raw=["acts"])
            pool, watched = sink.buffer_pool, sink.writer_pid
        else:
            sink = ClickHouseSink.embedded(SCHEMA, f"{data}/x", raw=["acts"])
            pool, watched = None, me
        runtime = create_record_runtime(record_sink=sink)
        for pattern in patterns:
            bind_modules(runtime, model, pattern, layout="acts", pool=pool)
        blocks = watch_blocks(sink) if kind == "thread" else None
        per_round = []
        start: dict[str, tuple[str, float]] = {}
        # CPU per thread name while flush() runs (the model is done): the tail.
        tail: collections.Counter[str] = collections.Counter()
        watched_pids = [me] + ([watched] if kind == "process" else [])
        for r in range(rounds + 1):  # round 0 warms up
            if r == 1:
                start = on_cpu(watched)
            before = by_thread(me)
            child_before = cpu(watched) if kind == "process" else 0.0
            began = time.perf_counter()
            if blocks is not None:
                blocks.clear()
            with torch.inference_mode(), capture_context(keys, attention_mask=mask):
                for _ in range(5):
                    forward(ids, mask)
            tail_before = [on_cpu(pid) for pid in watched_pids]
            forwarded = time.perf_counter()
            runtime.flush()
            flushed = time.perf_counter()
            if r and blocks is not None:
                print(f"  round {r}: " + timeline(blocks, began, forwarded, flushed))
            if r:
                for pid, before_tail in zip(watched_pids, tail_before, strict=True):
                    prefix = "model process: " if pid == me else "writer process: "
                    for name, seconds in spent_by_name(before_tail, on_cpu(pid)).items():
                        tail[prefix + name] += seconds
            after = by_thread(me)
            child = (cpu(watched) - child_before) if kind == "process" else 0.0
            if r:
                model_cpu = after[model_tid][1] - before[model_tid][1]
                others = sum(
                    v[1] - before.get(k, ("", 0.0))[1] for k, v in after.items() if k != model_tid
                )
                per_round.append((model_cpu, others, child, forwarded - began, flushed - forwarded))
        names = spent_by_name(start, on_cpu(watched))

        def med(i: int) -> float:
            return statistics.median(p[i] for p in per_round)

        print(
            f"{kind}: {rounds} rounds, load {os.getloadavg()[0]:.1f}; CPU s per round: "
            f"model thread {med(0):.3f}, model process's other threads {med(1):.3f}, "
            f"writer process "
            f"{med(2):.3f}; wall s per round: forward {med(3):.3f}, flush {med(4):.3f}"
        )
        watched_what = "writer process" if kind == "process" else "model process"
        top = [(k, round(v, 2)) for k, v in names.most_common(6)]
        print(f"  {watched_what} CPU s by thread name over the rounds: {top}")
        tail_top = [(k, round(v / rounds * 1e3, 1)) for k, v in tail.most_common(8) if v > 0]
        print(f"  during flush() (the tail), CPU ms per round by thread name: {tail_top}")
        runtime.close()


if __name__ == "__main__":
    main()
