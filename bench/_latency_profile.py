"""Where latency.py's stateless route spends its loop thread's time when
batches come paced (one at a time) rather than in a burst (issue #13).

    python bench/_latency_profile.py steps --rates max,200000,max,200000
    python bench/_latency_profile.py wake
    python bench/_latency_profile.py verdicts --rate 150000
    python bench/_latency_profile.py judging --rate 400000 --rounds 8
    python bench/_latency_profile.py timeline --rate 350000 --rounds 6
    py-spy record --threads --nonblocking -r 500 -f raw -o prof.txt -- \\
        python bench/_latency_profile.py paced --rate 200000 --seconds 2 --reps 4
    python bench/_pyspy_summary.py prof.txt

``steps``: latency.py's stateless route at each rate (records/s; ``max``:
unpaced), with a Trio instrument on the runtime's loop: CPU time (the
thread's own clock) per batch in each task's steps, in the scheduler
between steps, and in I/O waits, and how many steps and scheduler passes
a batch costs.  ``wake``: the loop thread's CPU per wake-up of a bare Trio
loop woken by a paced producer thread (``run_sync_soon``, with and without
the record worker's poll timeout; a socket of its own), against a thread
blocked in ``queue.Queue.get``.  ``verdicts``: each processor call of one
paced run, its wall and CPU time and its thread's context switches, what
:class:`~taproute.actors.attempt.Placement` was charged, and how many
calls ran in worker threads.  ``judging``: paced runs at one rate,
alternating how worker-thread calls are judged: by wall time whenever the
thread waited, with no doubling (before 2026-12), against the CPU time
of a call that waited under ``THREAD_WAIT_S`` and the doubling back-off;
p99 and max from the intended send time (every run starts a runtime,
whose first calls go to threads), and how many calls ran in threads.
``timeline``: where in a paced run the slow records fall (per 100 ms of
the run: p99, max, calls that ran in worker threads), and each run's p99
with and without its start.  ``paced``: the paced runs alone, for a
profiler.
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import latency
import trio


class StepClock(trio.abc.Instrument):
    """CPU time (thread clock, ns) per task name, in the scheduler, and in I/O waits."""

    def __init__(self) -> None:
        self.cpu: collections.Counter[str] = collections.Counter()
        self.count: collections.Counter[str] = collections.Counter()
        self._mark = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._mark = time.thread_time_ns()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        name = task.name.rsplit(".", 2)[-2:]
        key = ".".join(name)[:48]
        self.cpu[key] += time.thread_time_ns() - self._mark
        self.count[key] += 1

    def before_io_wait(self, timeout: float) -> None:
        self._mark = time.thread_time_ns()

    def after_io_wait(self, timeout: float) -> None:
        self.cpu["(io wait)"] += time.thread_time_ns() - self._mark
        self.count["(io wait)"] += 1


def steps(rates: list[float | None]) -> None:
    clock = StepClock()
    loop_cpu = [0]
    real_run = trio.run

    def run(fn: Callable[[], Any], *args: Any, **kwargs: Any) -> Any:
        async def timed() -> Any:
            started = time.thread_time_ns()
            try:
                return await fn(*args)
            finally:
                loop_cpu[0] += time.thread_time_ns() - started

        return real_run(timed, instruments=[clock], **kwargs)

    trio.run = run  # the runtime's loop thread calls trio.run
    for rate in rates:
        batches = 1500 if rate is None else int(rate * 2.0 / latency.PER_BATCH)
        clock.cpu.clear()
        clock.count.clear()
        loop_cpu[0] = 0
        got = latency.run("stateless", batches, rate, "/tmp")
        p99 = latency._percentiles(got["intended"])["p99_ms"]
        total = loop_cpu[0] / batches / 1e3
        in_steps = sum(v for k, v in clock.cpu.items() if k != "(io wait)") / batches / 1e3
        io = clock.cpu["(io wait)"] / batches / 1e3
        label = "unpaced" if rate is None else f"paced {rate:,.0f} rec/s"
        print(
            f"{label}: achieved {got['achieved_records_per_s']:,.0f} rec/s, p99 {p99:.1f} ms; "
            f"loop CPU {total:.0f} us/batch = task steps {in_steps:.0f} + io waits {io:.0f} "
            f"+ scheduler {total - in_steps - io:.0f}; load {os.getloadavg()[0]:.2f}"
        )
        for key, ns in clock.cpu.most_common(6):
            n = clock.count[key]
            print(
                f"    {key:48s} {ns / batches / 1e3:6.1f} us/batch  "
                f"{n / batches:5.2f} per batch  {ns / max(n, 1) / 1e3:6.1f} us each"
            )


def _thread_cpu(tid: int) -> float:
    fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


WAKES = 4000
INTERVAL_S = 640e-6  # 128 records every 640 us: 200,000 records/s


def _paced(kick: Callable[[], object]) -> None:
    start = time.perf_counter()
    for i in range(WAKES):
        ahead = start + i * INTERVAL_S - time.perf_counter()
        if ahead > 0:
            time.sleep(ahead)
        kick()


def _trio_token(poll: bool) -> float:
    box: dict[str, Any] = {"ready": threading.Event(), "n": 0}

    async def main() -> None:
        event = [trio.Event()]
        box["token"] = trio.lowlevel.current_trio_token()
        box["tid"] = threading.get_native_id()
        box["wake"] = lambda: event[0].set()
        box["ready"].set()
        while box["n"] < WAKES:
            if poll:
                with trio.move_on_after(0.02):
                    await event[0].wait()
            else:
                await event[0].wait()
            if event[0].is_set():
                event[0] = trio.Event()
                box["n"] += 1

    thread = threading.Thread(target=trio.run, args=(main,))
    thread.start()
    box["ready"].wait()
    before = _thread_cpu(box["tid"])
    _paced(lambda: box["token"].run_sync_soon(box["wake"]))
    time.sleep(0.05)
    spent = _thread_cpu(box["tid"]) - before
    box["n"] = WAKES
    box["token"].run_sync_soon(box["wake"])
    thread.join()
    return spent / WAKES * 1e6


def _trio_socket() -> float:
    box: dict[str, Any] = {"ready": threading.Event()}
    reader, writer = socket.socketpair()
    reader.setblocking(False)
    writer.setblocking(False)

    async def main() -> None:
        box["tid"] = threading.get_native_id()
        box["ready"].set()
        while True:
            await trio.lowlevel.wait_readable(reader)
            if b"\1" in reader.recv(4096):
                return

    thread = threading.Thread(target=trio.run, args=(main,))
    thread.start()
    box["ready"].wait()
    before = _thread_cpu(box["tid"])
    _paced(lambda: writer.send(b"\0"))
    time.sleep(0.05)
    spent = _thread_cpu(box["tid"]) - before
    writer.send(b"\1")
    thread.join()
    reader.close()
    writer.close()
    return spent / WAKES * 1e6


def _queue() -> float:
    q: queue.Queue[int | None] = queue.Queue()
    box: dict[str, Any] = {"ready": threading.Event()}

    def consume() -> None:
        box["tid"] = threading.get_native_id()
        box["ready"].set()
        while q.get() is not None:
            pass

    thread = threading.Thread(target=consume)
    thread.start()
    box["ready"].wait()
    before = _thread_cpu(box["tid"])
    _paced(lambda: q.put(1))
    time.sleep(0.05)
    spent = _thread_cpu(box["tid"]) - before
    q.put(None)
    thread.join()
    return spent / WAKES * 1e6


def wake(rounds: int) -> None:
    print(f"loop thread CPU per wake-up (us), {WAKES} wake-ups {INTERVAL_S * 1e6:.0f} us apart:")
    for _ in range(rounds):
        print(
            f"  run_sync_soon + poll timeout {_trio_token(True):.0f}; "
            f"run_sync_soon {_trio_token(False):.0f}; own socket {_trio_socket():.0f}; "
            f"queue.Queue consumer {_queue():.0f}; load {os.getloadavg()[0]:.2f}",
            flush=True,
        )


def paced(rate: float, seconds: float, reps: int) -> None:
    batches = int(rate * seconds / latency.PER_BATCH)
    for _ in range(reps):
        got = latency.run("stateless", batches, rate, "/tmp")
        p99 = latency._percentiles(got["intended"])["p99_ms"]
        print(f"paced {rate:,.0f}: achieved {got['achieved_records_per_s']:,.0f}, p99 {p99:.1f} ms")


def verdicts(rate: float, seconds: float) -> None:
    """Each processor call of one paced run: its wall time, its thread's CPU
    time and context switches (getrusage), what Placement was charged, and
    where it ran; the calls charged 0.5 ms or more, and how many ran in
    worker threads."""
    import resource

    import taproute.actors.attempt as attempt

    log: list[tuple[bool, float, float, float, int, int]] = []
    charged_call = attempt.timed_call

    def timed_call(
        fn: Callable[..., Any], *args: Any, in_thread: bool = False
    ) -> tuple[Any, float]:
        before = resource.getrusage(resource.RUSAGE_THREAD)
        started = time.perf_counter()
        result, charged = charged_call(fn, *args, in_thread=in_thread)
        wall = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_THREAD)
        cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
        on_loop = threading.current_thread().name.startswith("taproute")
        log.append(
            (
                on_loop,
                wall,
                cpu,
                charged,
                after.ru_nvcsw - before.ru_nvcsw,
                after.ru_nivcsw - before.ru_nivcsw,
            )
        )
        return result, charged

    attempt.timed_call = timed_call  # type: ignore[assignment]
    latency.run("stateless", int(rate * seconds / latency.PER_BATCH), rate, "/tmp")
    slow = [entry for entry in log if entry[1] >= attempt.INLINE_BELOW_S]
    print(
        f"paced {rate:,.0f} rec/s: {len(log)} calls, {sum(not e[0] for e in log)} in worker "
        f"threads; {len(slow)} of 0.5 ms wall or more, "
        f"{sum(e[3] >= attempt.INLINE_BELOW_S for e in log)} charged 0.5 ms or more; "
        f"load {os.getloadavg()[0]:.2f}"
    )
    print("  where   wall ms  cpu ms  charged ms  voluntary  involuntary switches")
    for on_loop, wall, cpu, charged, vol, invol in slow[:20]:
        print(
            f"  {'loop' if on_loop else 'thread':6s} {wall * 1e3:8.2f} {cpu * 1e3:7.2f} "
            f"{charged * 1e3:11.2f} {vol:10d} {invol:12d}"
        )


def judging(rate: float, rounds: int, seconds: float) -> None:
    import numpy as np
    from _judging import judge_thread_calls

    import taproute.actors.attempt as attempt

    def use(name: str) -> None:
        judge_thread_calls("wall" if name == "wall when waited" else "cpu")

    threads = [0]
    took = attempt.Placement.took

    def counted(self: attempt.Placement, elapsed: float) -> None:
        threads[0] += not self.inline
        took(self, elapsed)

    attempt.Placement.took = counted  # type: ignore[method-assign]
    names = ["wall when waited", "cpu under THREAD_WAIT_S, doubling"]
    found: dict[str, list[tuple[float, float, int]]] = {name: [] for name in names}
    latency.run("stateless", 500, None, "/tmp")  # warm-up
    batches = int(rate * seconds / latency.PER_BATCH)
    for round_ in range(rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            use(name)
            threads[0] = 0
            got = latency.run("stateless", batches, rate, "/tmp")
            hist = got["intended"]
            found[name].append(
                (
                    hist.get_value_at_percentile(99) / 1e3,
                    hist.get_max_value() / 1e3,
                    threads[0],
                )
            )
    use(names[1])
    print(
        f"stateless route paced at {rate:,.0f} records/s, {seconds} s a run, {rounds} runs "
        f"each, alternated; load {os.getloadavg()[0]:.2f}"
    )
    for name in names:
        p99 = [p for p, _, _ in found[name]]
        print(
            f"  {name:36s} p99 ms median {np.median(p99):.2f}, runs "
            + " ".join(f"{p:.2f}" for p in sorted(p99))
            + f"; max ms median {np.median([m for _, m, _ in found[name]]):.2f}"
            + f"; calls in threads per run median {np.median([t for _, _, t in found[name]]):.0f}"
        )


def timeline(rate: float, rounds: int, seconds: float, bucket_ms: float) -> None:
    """Where in a paced run its slow records fall: per ``bucket_ms`` of the
    run (by intended send time), the records' p99 and max latency from
    their intended send time, the processor calls that ran in worker
    threads, how late the producer itself submitted (its largest lateness:
    a pacer that overslept or was descheduled) and the router's own p99
    (receipt - actual submit); then each run's p99 with and without its
    first buckets."""
    import numpy as np

    import taproute.actors.attempt as attempt

    calls: list[tuple[int, bool]] = []
    took = attempt.Placement.took

    def noted(self: attempt.Placement, elapsed: float) -> None:
        calls.append((time.perf_counter_ns(), not self.inline))
        took(self, elapsed)

    arrivals: list[tuple[np.ndarray, np.ndarray, int]] = []
    note = latency.Receipts.note

    def noting(self: latency.Receipts, intended: np.ndarray, actual: np.ndarray) -> None:
        arrivals.append(
            (np.asarray(intended).copy(), np.asarray(actual).copy(), time.perf_counter_ns())
        )
        note(self, intended, actual)

    # Collections while a run is paced (pace() collects before its clock
    # starts): when, which generation, how long.
    pauses: list[tuple[int, int, float]] = []
    started_gc = [0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started_gc[0] = time.perf_counter_ns()
        else:
            pauses.append((started_gc[0], info["generation"], time.perf_counter_ns()))

    attempt.Placement.took = noted  # type: ignore[method-assign]
    latency.Receipts.note = noting  # type: ignore[method-assign]
    latency.run("stateless", 500, None, "/tmp")  # warm-up (imports, first compiles)
    gc.callbacks.append(on_gc)
    batches = int(rate * seconds / latency.PER_BATCH)
    width = int(bucket_ms * 1e6)
    nbuckets = int(seconds * 1e3 / bucket_ms) + 1
    per_bucket: list[list[np.ndarray]] = [[] for _ in range(nbuckets)]
    # The producer's own lateness (submitted after its due time: the pacer
    # overslept or was descheduled) and the router's part (receipt - submit).
    late_per_bucket: list[list[np.ndarray]] = [[] for _ in range(nbuckets)]
    router_per_bucket: list[list[np.ndarray]] = [[] for _ in range(nbuckets)]
    threads_per_bucket = np.zeros(nbuckets, dtype=np.int64)
    p99_all, p99_after = [], []
    skip = 2  # buckets left out for "after the start"
    collected: list[tuple[int, float, int]] = []  # (round, ms into it, generation)
    slowest = 0.0
    for round_ in range(rounds):
        calls.clear()
        arrivals.clear()
        pauses.clear()
        latency.run("stateless", batches, rate, "/tmp")
        t0 = min(int(a.min()) for a, _, _ in arrivals)
        for began, generation, ended in pauses:
            if began >= t0:
                collected.append((round_, (began - t0) / 1e6, generation))
                slowest = max(slowest, (ended - began) / 1e6)
        lat = np.concatenate([(done - a) / 1e6 for a, _, done in arrivals])
        late = np.concatenate([(s - a) / 1e6 for a, s, _ in arrivals])
        router = np.concatenate([(done - s) / 1e6 for _, s, done in arrivals])
        sent = np.concatenate([a for a, _, _ in arrivals])
        index = np.minimum((sent - t0) // width, nbuckets - 1)
        for b in range(nbuckets):
            per_bucket[b].append(lat[index == b])
            late_per_bucket[b].append(late[index == b])
            router_per_bucket[b].append(router[index == b])
        for when, in_thread in calls:
            if in_thread and when >= t0:
                threads_per_bucket[min((when - t0) // width, nbuckets - 1)] += 1
        p99_all.append(float(np.percentile(lat, 99)))
        p99_after.append(float(np.percentile(lat[index >= skip], 99)))
    gc.callbacks.remove(on_gc)
    attempt.Placement.took = took  # type: ignore[method-assign]
    latency.Receipts.note = note  # type: ignore[method-assign]
    print(
        f"stateless route paced at {rate:,.0f} records/s, {seconds} s a run, {rounds} runs; "
        f"load {os.getloadavg()[0]:.2f}; latency from the intended send time, ms"
    )
    print(
        f"  {'from ms':>8s} {'records':>8s} {'p99':>8s} {'max':>8s} {'thread calls':>12s} "
        f"{'submit late max':>15s} {'router p99':>10s}"
    )
    for b in range(nbuckets):
        got = np.concatenate(per_bucket[b])
        if not len(got):
            continue
        late_b = np.concatenate(late_per_bucket[b])
        router_b = np.concatenate(router_per_bucket[b])
        print(
            f"  {b * bucket_ms:8.0f} {len(got):8d} {np.percentile(got, 99):8.2f} "
            f"{got.max():8.2f} {threads_per_bucket[b]:12d} {late_b.max():15.2f} "
            f"{np.percentile(router_b, 99):10.2f}"
        )
    print(
        f"  p99 of each run, ms: {' '.join(f'{p:.2f}' for p in p99_all)} (median "
        f"{np.median(p99_all):.2f}); leaving out the first {skip * bucket_ms:.0f} ms: "
        f"{' '.join(f'{p:.2f}' for p in p99_after)} (median {np.median(p99_after):.2f})"
    )
    by_generation = {g: sum(1 for c in collected if c[2] == g) for g in range(3)}
    print(
        f"  garbage collections during the runs, per generation: {by_generation}; the longest "
        f"{slowest:.2f} ms; full ones at (run, ms into it): "
        + (", ".join(f"({r}, {t:.0f})" for r, t, g in collected if g == 2) or "none")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    s = sub.add_parser("steps")
    s.add_argument("--rates", default="max,200000,max,200000")
    w = sub.add_parser("wake")
    w.add_argument("--rounds", type=int, default=3)
    v = sub.add_parser("verdicts")
    v.add_argument("--rate", type=float, default=150_000)
    v.add_argument("--seconds", type=float, default=2.0)
    j = sub.add_parser("judging")
    j.add_argument("--rate", type=float, default=400_000)
    j.add_argument("--rounds", type=int, default=8)
    j.add_argument("--seconds", type=float, default=2.5)
    t = sub.add_parser("timeline")
    t.add_argument("--rate", type=float, default=350_000)
    t.add_argument("--rounds", type=int, default=6)
    t.add_argument("--seconds", type=float, default=2.5)
    t.add_argument("--bucket-ms", type=float, default=100.0)
    p = sub.add_parser("paced")
    p.add_argument("--rate", type=float, default=200_000)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--reps", type=int, default=4)
    args = parser.parse_args()
    if args.what == "steps":
        steps([None if r == "max" else float(r) for r in args.rates.split(",")])
    elif args.what == "wake":
        wake(args.rounds)
    elif args.what == "verdicts":
        verdicts(args.rate, args.seconds)
    elif args.what == "judging":
        judging(args.rate, args.rounds, args.seconds)
    elif args.what == "timeline":
        timeline(args.rate, args.rounds, args.seconds, args.bucket_ms)
    else:
        paced(args.rate, args.seconds, args.reps)


if __name__ == "__main__":
    main()
