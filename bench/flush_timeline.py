"""Probe: what ``flush()`` waits for after the last forward pass (a timeline).

# bench: not a script

The inference-cost workload (GPT-2 4 x 256 from a config, batch 8 x 64 with
half the rows padded to half length, 12 hooks, torch on one thread, rounds of
``--passes`` forward passes then ``flush()``), into chDB in this process,
with the ClickHouse sink's early seal on (``Batching(early_bytes=EARLY)``,
2 MiB: a table's buffer becomes an insert at ``early_bytes`` while none of
its inserts runs) and off (``Batching()``, the default: sealed only when
full), alternated
round by round with no hooks and the naive copy hook.  Per round: forward
time, time until ``flush()`` returned, and every insert's start, end and
size relative to the end of the last forward pass (from a wrapper around the
transport's ``insert``)::

    python bench/flush_timeline.py --rounds 9 > bench/profiles/flush_timeline_<commit>.txt

``--kinds`` picks the variants; ``early_file`` / ``late_file`` are ``early`` /
``late`` with blocks handed to chDB as in-memory Arrow files
(``ChdbTransport(scratch_inserts=True)``, read without the GIL) instead of
through ``Python()``: the model thread's "blocked" time (its GIL waits) is
the figure that says what that changes.

Read ratios of one run: the machine is shared.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import attrs
import torch
from harness import quantile
from inference_cost import SCHEMA, fix_malloc, naive_hooks, probe_gpt2

from taproute.service import Batching, ClickHouseSink, create_record_runtime
from taproute.service.capture import bind_modules, capture_context
from taproute.service.sinks.clickhouse import ChdbTransport
from taproute.service.sinks.writer import WriterProcessSink

#: The early seal measured against the default (off).
EARLY = 2 * 2**20

#: One insert: (start, end) seconds relative to the end of the forward
#: passes, and its bytes.
Insert = tuple[float, float, int]


@attrs.frozen
class Round:
    """One round's figures (seconds): forward wall per pass; the model
    thread's CPU, run-queue wait and blocked time (neither running nor
    runnable: waiting for the GIL, as the thread does no I/O) per pass, from
    its ``schedstat``; how long ``flush()`` waited after the last pass and the
    CPU spent meanwhile (this process plus the writer process); the round's
    whole CPU (the same two); the inserts (in-process only)."""

    forward: float
    model_cpu: float
    model_runq: float
    model_blocked: float
    flush_wait: float
    flush_cpu: float
    cpu: float
    inserts: list[Insert]


def child_cpu(pid: int | None) -> float:
    """User + system CPU seconds of process ``pid`` (0 without one)."""
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def schedstat() -> tuple[float, float]:
    """This thread's seconds on CPU and waiting in the run queue."""
    tid = threading.get_native_id()
    on, wait, _ = Path(f"/proc/self/task/{tid}/schedstat").read_text().split()
    return int(on) / 1e9, int(wait) / 1e9


class TimedTransport:
    """Wraps a transport's ``insert`` to keep when each ran (thread-safe)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.inserts: list[tuple[float, float, int]] = []
        self._lock = threading.Lock()

    def insert(self, table: str, data: Any, *, dedup_token: str) -> None:
        began = time.perf_counter()
        self.inner.insert(table, data, dedup_token=dedup_token)
        with self._lock:
            self.inserts.append((began, time.perf_counter(), data.nbytes))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument(
        "--kinds",
        type=lambda text: text.split(","),
        default=["none", "naive", "early", "late", "p_early", "p_late"],
        help="comma-separated, of: none, naive, early, late, early_file, late_file (inserts "
        "from an in-memory Arrow file, ChdbTransport(scratch_inserts=True), instead of "
        "Python()), p_early, p_late",
    )
    args = parser.parse_args()
    malloc = fix_malloc("fixed")
    model, patterns, forward, ids, mask = probe_gpt2()
    keys = list(range(8))
    kept: list[Any] = []
    timings: dict[str, list[Round]] = {}
    with tempfile.TemporaryDirectory(prefix="taproute-flush-timeline-") as data_dir:
        runtimes: dict[str, tuple[Any, TimedTransport | None]] = {}
        for name, batching, scratch in (
            ("early", Batching(early_bytes=EARLY), None),
            ("late", Batching(), None),
            ("early_file", Batching(early_bytes=EARLY), True),
            ("late_file", Batching(), True),
        ):
            if name not in args.kinds:
                continue
            sink = ClickHouseSink(
                ChdbTransport(data_dir, scratch_inserts=scratch),
                SCHEMA,
                raw=["acts"],
                raw_table=f"raw_{{layout}}_{name}",
                create_tables=True,
            )
            sink.batching = batching
            timed = TimedTransport(sink.transport)
            sink.transport = timed  # type: ignore[assignment]
            runtimes[name] = (create_record_runtime(record_sink=sink), timed)
        writers: dict[str, WriterProcessSink] = {}
        for name, batching in (
            ("p_early", Batching(early_bytes=EARLY)),
            ("p_late", Batching()),
        ):
            if name not in args.kinds:
                continue
            writer = WriterProcessSink.embedded(
                SCHEMA, f"{data_dir}/{name}", raw=["acts"], batching=batching
            )
            writers[name] = writer
            runtimes[name] = (create_record_runtime(record_sink=writer), None)

        def passes() -> tuple[float, float, tuple[float, float, float]]:
            on, wait = schedstat()
            started = time.perf_counter()
            with torch.inference_mode(), capture_context(keys, attention_mask=mask):
                for _ in range(args.passes):
                    forward(ids, mask)
            ended = time.perf_counter()
            on_after, wait_after = schedstat()
            cpu, runq = on_after - on, wait_after - wait
            n = args.passes
            return started, ended, (cpu / n, runq / n, (ended - started - cpu - runq) / n)

        def one(kind: str) -> Round:
            cpu = time.process_time()
            if kind in ("none", "naive"):
                handles = naive_hooks(model, patterns, kept) if kind == "naive" else []
                try:
                    started, ended, model_thread = passes()
                finally:
                    for handle in handles:
                        handle.remove()
                    kept.clear()
                return Round(
                    (ended - started) / args.passes,
                    *model_thread,
                    0.0,
                    0.0,
                    time.process_time() - cpu,
                    [],
                )
            runtime, timed = runtimes[kind]
            writer = writers.get(kind)
            pid = writer.writer_pid if writer is not None else None
            child = child_cpu(pid)
            pool = writer.buffer_pool if writer is not None else None
            bindings = [
                b
                for p in patterns
                for b in bind_modules(runtime, model, p, layout="acts", pool=pool)
            ]
            try:
                if timed is not None:
                    timed.inserts.clear()
                started, ended, model_thread = passes()
                at_end = time.process_time() + child_cpu(pid)
                runtime.flush()
                flushed = time.perf_counter()
                flush_cpu = time.process_time() + child_cpu(pid) - at_end
            finally:
                for binding in bindings:
                    binding.remove()
            inserts = (
                [] if timed is None else [(a - ended, b - ended, n) for a, b, n in timed.inserts]
            )
            return Round(
                (ended - started) / args.passes,
                *model_thread,
                flushed - ended,
                flush_cpu,
                time.process_time() - cpu + child_cpu(pid) - child,
                inserts,
            )

        kinds = args.kinds
        for round_ in range(args.rounds + 1):
            order = kinds if round_ % 2 else kinds[::-1]
            for kind in order:
                result = one(kind)
                if round_:
                    timings.setdefault(kind, []).append(result)
        for runtime, _ in runtimes.values():
            runtime.close()

    load = os.getloadavg()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    print(f"commit {commit}, load average {load[0]:.1f} at the end, malloc {malloc}")
    print(f"{args.rounds} rounds of {args.passes} forward passes + flush(), kinds alternated\n")
    rows = timings
    base = quantile([r.forward for r in rows["none"]], 0.5)

    def ms(kind: str, field: str) -> float:
        return quantile([getattr(r, field) for r in rows[kind]], 0.5) * 1e3

    print(
        "medians, ms (model thread per pass: CPU / run-queue wait / blocked, i.e. GIL waits;"
        " CPU: this process + the writer process)"
    )
    for kind in kinds:
        fwd = ms(kind, "forward")
        until = fwd + ms(kind, "flush_wait") / args.passes
        print(
            f"{kind:7s} forward {fwd:6.2f}/pass ({fwd / base / 1e3:.3f}x none), "
            f"model thread {ms(kind, 'model_cpu'):5.2f} / {ms(kind, 'model_runq'):5.2f} / "
            f"{ms(kind, 'model_blocked'):5.2f}; flush wait {ms(kind, 'flush_wait'):5.1f} "
            f"(CPU {ms(kind, 'flush_cpu'):5.1f}); until flush {until / base / 1e3:.3f}x; "
            f"CPU/round {ms(kind, 'cpu'):4.0f}; inserts/round "
            f"{quantile([len(r.inserts) for r in rows[kind]], 0.5):.0f}"
        )
    for kind in [k for k in ("early", "late", "early_file", "late_file") if k in kinds]:
        print(f"\n{kind}: inserts per round, ms relative to the end of the forward passes")
        for r in timings[kind]:
            tail, inserts = r.flush_wait, r.inserts
            spans = "  ".join(
                f"[{a * 1e3:+6.0f},{b * 1e3:+6.0f}] {n / 2**20:4.1f}M" for a, b, n in inserts
            )
            print(f"  flush wait {tail * 1e3:5.1f}:  {spans}")


if __name__ == "__main__":
    main()
