"""Drive one bench workload repeatedly for a profiler, printing each run's
rate and CPU time per thread (from /proc, so a loaded machine's waits do
not count as work).

    python bench/_profile_drive.py stateful --owners 2 --reps 3
    python bench/_profile_drive.py stateless --batches 2000 --reps 3
    python bench/_profile_drive.py chains --records 400000 --reps 3
    py-spy record --threads --nonblocking -r 500 -f raw -o prof.txt -- \\
        python bench/_profile_drive.py stateful --owners 1 --reps 6
    python bench/_pyspy_summary.py prof.txt

``stateful``: ``stateful_vs_bytewax.py``'s stateful route (4096 keys x 64
floats, 4096 records per batch, 400,000 records), then the bare function
and Bytewax on the same batches.  ``stateless``: ``latency.py``'s stateless
route, unpaced (its capacity run), 128 MiniLM token records per batch.
``chains``: ``chains.py``'s 2-route chain and the same calls fanned out,
then the thread + queue peer and the bare functions.
Threads are named by role: main (the producer), the runtime's loop thread,
Trio's worker threads.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu() -> dict[str, tuple[str, float]]:
    """tid -> (role, CPU seconds) for every live thread of this process."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            comm = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = "main" if int(tid) == os.getpid() else comm
        if name.startswith("Trio thread"):
            name = "trio workers"
        out[tid] = (name, (int(fields[11]) + int(fields[12])) / TICK)
    return out


def per_thread(run: Callable[[], float], units: int) -> str:
    before = thread_cpu()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    rate = run()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    after = thread_cpu()
    spent = {"main": 0.0, "trio workers": 0.0}
    for tid, (name, seconds) in after.items():
        if name in spent:
            spent[name] += seconds - before.get(tid, (name, 0.0))[1]
    # The runtime's loop thread is gone once the run closed it: it is the rest.
    spent["loop and other threads"] = cpu - sum(spent.values())
    parts = ", ".join(f"{k} {v / units * 1e6:.0f}" for k, v in spent.items() if v > 0)
    return (
        f"{rate:,.0f} records/s; wall {wall:.3f} s, CPU {cpu:.3f} s "
        f"({cpu / units * 1e6:.0f} us per batch: {parts})"
    )


def stateful(args: argparse.Namespace) -> None:
    import stateful_vs_bytewax as s

    batches = s.make_batches(400_000)
    s.taproute_run(batches[:4], args.owners)  # warm-up
    for _ in range(args.reps):
        line = per_thread(lambda: s.taproute_run(batches, args.owners)[0], len(batches))
        print(f"taproute, {args.owners} owner(s): {line}", flush=True)
    print(f"bare function: {per_thread(lambda: s.bare_run(batches)[0], len(batches))}")
    print(f"Bytewax: {per_thread(lambda: s.bytewax_run(batches)[0], len(batches))}")


def chains(args: argparse.Namespace) -> None:
    import chains as c

    batches = c.make_batches(args.records)
    c.taproute_run(batches[:4])  # warm-up
    for _ in range(args.reps):
        line = per_thread(lambda: c.taproute_run(batches)[0], len(batches))
        print(f"taproute, chain of 2 routes: {line}", flush=True)
        line = per_thread(lambda: c.fanout_run(batches), len(batches))
        print(f"taproute, 2 routes fanned out: {line}", flush=True)
    print(f"thread + queue: {per_thread(lambda: c.thread_run(batches)[0], len(batches))}")
    print(f"bare functions: {per_thread(lambda: c.bare_run(batches)[0], len(batches))}")


def stateless(args: argparse.Namespace) -> None:
    import latency as lat

    with tempfile.TemporaryDirectory() as folder:
        lat.run("stateless", 50, None, folder)  # warm-up
        for _ in range(args.reps):
            line = per_thread(
                lambda: float(
                    lat.run("stateless", args.batches, None, folder)["achieved_records_per_s"]
                ),
                args.batches,
            )
            print(f"taproute stateless route: {line}", flush=True)
            peer = per_thread(
                lambda: float(
                    lat.run_peer("stateless", args.batches, None)["achieved_records_per_s"]
                ),
                args.batches,
            )
            print(f"peer (thread + queue.Queue): {peer}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workload", choices=("stateful", "stateless", "chains"))
    parser.add_argument("--owners", type=int, default=1)
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--records", type=int, default=400_000, help="chains: records per run")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--malloc", default="fixed", help="as the benches: fixed or default")
    args = parser.parse_args()
    from harness import fix_malloc

    print(f"load average {os.getloadavg()}; malloc: {fix_malloc(args.malloc)}", flush=True)
    {"stateful": stateful, "stateless": stateless, "chains": chains}[args.workload](args)


if __name__ == "__main__":
    main()
