"""What work on the *other* core costs the model thread's own CPU time (a
probe, not part of the suite; issue #13, part 2).

    python bench/neighbour_probe.py [--rounds 6] [--forwards 10]

The inference-cost bench finds the model thread's CPU time per GPT-2 forward
pass 5-8% higher while chDB inserts the captured rows, in-process or in a
writer process, although the model's hooks are the same as with a null
destination (which costs nothing measurable) and, in a writer process, no GIL
is shared.  This probe asks whether any busy neighbour does that, and which
kind: the model process is pinned to CPU 0, and a neighbour process, pinned
to CPU 1, runs flat out one of

- ``none``: nothing (the reference);
- ``alu``: a pure-Python counting loop (no memory traffic to speak of);
- ``memcpy``: numpy copies between two 64 MiB arrays (memory bandwidth and
  the shared cache, nothing else);
- ``chdb``: chDB inserting Arrow blocks of GPT-2-sized raw records (1 KiB of
  float32 per record, 10 MiB blocks, ``ORDER BY (hook, key, step, seq)``,
  through ``Python()``), as taproute's sink does.

Rounds interleave the variants; each runs ``--forwards`` forward passes
(GPT-2, 4 layers x 256, batch 8 x 64, torch on one thread, no hooks) while
its neighbour runs.  Reported per variant: the model thread's CPU time and
wall time per forward, median over rounds, and their ratios to ``none``.
The output is printed; keep it under ``bench/profiles/`` with the commit.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NEIGHBOURS = ("none", "alu", "memcpy", "chdb")


def neighbour(kind: str) -> None:
    """Run ``kind`` flat out on CPU 1 until killed (a child process)."""
    os.sched_setaffinity(0, {1})
    if kind == "alu":
        print("ready", flush=True)
        n = 0
        while True:
            n += 1
    if kind == "memcpy":
        import numpy as np

        a = np.ones(64 << 20, dtype=np.uint8)
        b = np.empty_like(a)
        print("ready", flush=True)
        while True:
            np.copyto(b, a)
            np.copyto(a, b)
    if kind == "chdb":
        import chdb.session
        import numpy as np
        import pyarrow as pa

        folder = tempfile.mkdtemp(prefix="neighbour-chdb-")
        session = chdb.session.Session(folder)
        session.query(
            "CREATE TABLE t (hook LowCardinality(String), key Int64, step Int64, seq Int64, "
            "values Array(Float32)) ENGINE = MergeTree ORDER BY (hook, key, step, seq)"
        )
        rows = 10 * 1024  # 10 MiB of 1 KiB records
        rng = np.random.default_rng(0)
        values = rng.standard_normal(rows * 256, dtype=np.float32)
        hooks = [f"transformer.h.{i % 4}.mlp" for i in range(12)]
        # Python(table) finds `table` among this frame's variables.
        table = pa.table(  # noqa: F841
            {
                "hook": pa.array([hooks[i % 12] for i in range(rows)]).dictionary_encode(),
                "key": pa.array(np.arange(rows, dtype=np.int64) // 512 % 8),
                "step": pa.array(np.zeros(rows, dtype=np.int64)),
                "seq": pa.array(np.arange(rows, dtype=np.int64) % 64),
                "values": pa.FixedSizeListArray.from_arrays(pa.array(values), 256).cast(
                    pa.list_(pa.float32())
                ),
            }
        )
        print("ready", flush=True)
        while True:
            session.query("INSERT INTO t SELECT * FROM Python(table)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--forwards", type=int, default=10)
    parser.add_argument("--neighbour", choices=NEIGHBOURS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.neighbour:
        neighbour(args.neighbour)
        return

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from inference_cost import probe_gpt2

    os.sched_setaffinity(0, {0})
    _model, _patterns, forward, ids, mask = probe_gpt2()
    with torch.inference_mode():
        for _ in range(5):
            forward(ids, mask)  # warm-up
        cpu: dict[str, list[float]] = {kind: [] for kind in NEIGHBOURS}
        wall: dict[str, list[float]] = {kind: [] for kind in NEIGHBOURS}
        for round_ in range(args.rounds):
            order = NEIGHBOURS if round_ % 2 == 0 else NEIGHBOURS[::-1]
            for kind in order:
                child = None
                if kind != "none":
                    child = subprocess.Popen(
                        [sys.executable, __file__, "--neighbour", kind],
                        stdout=subprocess.PIPE,
                        text=True,
                    )
                    assert child.stdout is not None
                    assert child.stdout.readline().strip() == "ready"
                    time.sleep(0.2)  # let it reach its steady state (not a synchronisation)
                try:
                    started_cpu, started = time.thread_time(), time.perf_counter()
                    for _ in range(args.forwards):
                        forward(ids, mask)
                    cpu[kind].append((time.thread_time() - started_cpu) / args.forwards)
                    wall[kind].append((time.perf_counter() - started) / args.forwards)
                finally:
                    if child is not None:
                        child.kill()
                        child.wait()
    base_cpu = statistics.median(cpu["none"])
    base_wall = statistics.median(wall["none"])
    print(
        f"GPT-2 forward (4 x 256, batch 8 x 64, torch 1 thread) on CPU 0, neighbour on "
        f"CPU 1; {args.rounds} rounds x {args.forwards} forwards, interleaved; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    print("neighbour  model CPU ms/fwd  x none   wall ms/fwd  x none   CPU per round (ms)")
    for kind in NEIGHBOURS:
        c, w = statistics.median(cpu[kind]), statistics.median(wall[kind])
        runs = " ".join(f"{x * 1e3:.1f}" for x in cpu[kind])
        print(
            f"{kind:9s}  {c * 1e3:16.2f}  {c / base_cpu:6.3f}  {w * 1e3:11.2f}  "
            f"{w / base_wall:6.3f}   {runs}"
        )


if __name__ == "__main__":
    main()
