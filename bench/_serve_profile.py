"""Profile ``bench/inference_server.py`` under ``serve_load.py``'s load: CPU
per thread of the server process (from ``/proc``, so waits for a core on a
loaded machine do not count as work), the load generator's own CPU, and
optionally a py-spy profile of the server while it runs.

    python bench/_serve_profile.py --capture on --workload generate --seconds 8 \\
        [--rate 50] [--pyspy prof.txt [--gil]]
    python bench/_pyspy_summary.py prof.txt

Threads are grouped by name (``comm``): ``http`` (the asyncio loop running
hypercorn, the batchers and the endpoints), ``embed_0`` / ``generate_0``
(the model threads), the runtime's Trio loop, Trio's worker threads
(processors, chDB inserts from Python), chDB's own C++ threads (named by
ClickHouse: merges, pipelines, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import serve_load  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[int, tuple[str, float, int]]:
    """tid -> (name, CPU seconds, voluntary context switches) for every live
    thread of ``pid``.  A Python thread that does no I/O switches voluntarily
    when it waits: for the GIL, a lock, a condition."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:
            continue
        waits = next(
            int(line.split()[1])
            for line in status.splitlines()
            if line.startswith("voluntary_ctxt_switches")
        )
        out[int(tid)] = (comm, (int(fields[11]) + int(fields[12])) / TICK, waits)
    return out


def python_names(pid: int) -> dict[int, str]:
    """OS thread id -> Python thread name (``py-spy dump --json``); the OS
    name of a Python thread is its interpreter's, not its own."""
    import json

    try:
        out = subprocess.run(
            ["py-spy", "dump", "--json", "--pid", str(pid)],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    names = {}
    for thread in json.loads(out):
        stack = ";".join(f"{f['name']} ({f['filename']})" for f in thread.get("frames", []))
        name = thread.get("thread_name") or "?"
        if "_thread_main" in stack:  # the runtime's Trio loop
            name = f"{name} [trio loop]"
        if thread.get("os_thread_id"):
            names[int(thread["os_thread_id"])] = name
    return names


def group(name: str, tid: int, pid: int) -> str:
    if tid == pid:
        return "main"
    if name.startswith("Trio thread"):
        return "trio workers"
    return re.sub(r"[-_ ]?\d+$", "", name) or name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--capture", choices=("on", "off"), default="on")
    parser.add_argument("--workload", choices=("embed", "generate"), default="generate")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rate", type=float, default=None, help="open loop; default saturation")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--pyspy")
    parser.add_argument("--gil", action="store_true")
    parser.add_argument("--idle", action="store_true")
    parser.add_argument("--writer", choices=("thread", "process"), default="thread")
    parser.add_argument("--merge-batches", choices=("on", "off"), default="on")
    parser.add_argument("--switch-interval-ms", type=float, default=0.0, help="0: Python's 5 ms")
    args = parser.parse_args()
    data = Path(tempfile.mkdtemp(prefix="serve-prof-"))
    server = serve_load.Server(
        args.capture == "on",
        data / "db",
        1,
        50.0,
        data / "server.log",
        writer=args.writer,
        merge_batches=args.merge_batches == "on",
        switch_interval_ms=args.switch_interval_ms,
    )
    server.wait_ready()
    try:
        work = serve_load.Workload(args.workload, args.max_new_tokens)
        # warm-up
        asyncio.run(serve_load.run_phase(server, work, rate=None, clients=8, duration=2.0))
        pid = server.process.pid
        spy = None
        if args.pyspy:
            cmd = ["py-spy", "record", "--threads", "-r", "200", "-f", "raw", "-o", args.pyspy]
            cmd += ["--pid", str(pid), "-d", str(int(args.seconds + 1))]
            cmd += ["--gil"] if args.gil else []
            cmd += ["--idle"] if args.idle else []
            spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(0.5)
        load0 = os.getloadavg()
        before = thread_cpu(pid)
        import psutil

        children = psutil.Process(pid).children(recursive=True)
        kids0 = sum(sum(c.cpu_times()[:2]) for c in children)
        me0 = time.process_time()
        wall0 = time.perf_counter()
        phase = asyncio.run(
            serve_load.run_phase(
                server, work, rate=args.rate, clients=args.clients, duration=args.seconds
            )
        )
        wall = time.perf_counter() - wall0
        me = time.process_time() - me0
        after = thread_cpu(pid)
        kids = sum(sum(c.cpu_times()[:2]) for c in children) - kids0
        if spy is not None:  # one py-spy at a time: the record ends before the dump
            spy.wait()
        names = python_names(pid)
        after = {tid: (names.get(tid, name), sec, w) for tid, (name, sec, w) in after.items()}
        spent: collections.Counter[str] = collections.Counter()
        waited: collections.Counter[str] = collections.Counter()
        for tid, (name, sec, w) in after.items():
            _, sec0, w0 = before.get(tid, (name, 0.0, 0))
            spent[group(name, tid, pid)] += sec - sec0
            waited[group(name, tid, pid)] += w - w0
        fig = phase.figures()
        print(
            f"capture {args.capture} (merge {args.merge_batches}, switch interval "
            f"{args.switch_interval_ms or 5:g} ms), {args.workload}, "
            f"{'saturation' if args.rate is None else f'{args.rate} req/s'}: "
            f"{fig['requests_per_s']:.1f} req/s "
            f"({fig['requests_per_s_persisted']:.1f} until flushed), "
            f"p50 {fig['p50_ms']:.1f} ms, p99 {fig['p99_ms']:.1f} ms, "
            f"flush {fig['flush_seconds']:.2f} s; "
            f"load average {load0[0]:.2f} -> {os.getloadavg()[0]:.2f}"
        )
        total = sum(spent.values())
        requests = max(phase.ok, 1)
        print(
            f"server CPU {total:.2f} s over {wall:.2f} s wall ({total / wall:.2f} cores); "
            f"load generator (this process) {me:.2f} s ({me / wall:.2f} cores); "
            f"{phase.ok} requests, server CPU {total / requests * 1e3:.2f} ms per request"
        )
        if children:
            print(
                f"  writer process(es): {kids:.2f} s  {kids / wall:5.2f} cores  "
                f"{kids / requests * 1e3:6.2f} ms/request"
            )
        for name, sec in spent.most_common():
            if sec > 0.005:
                print(
                    f"  {name:28s} {sec:7.2f} s  {sec / wall:5.2f} cores  "
                    f"{sec / requests * 1e3:6.2f} ms/request  "
                    f"{waited[name] / requests:7.1f} waits/request"
                )
    finally:  # never leave a server (and its writer) behind
        server.stop()


if __name__ == "__main__":
    main()
