"""Probe: the model thread's CPU with capture, inside the hooks and beside them.

# bench: not a script

The hook probes' GPT-2 workload (``probe_gpt2``: 4 x 256, batch 8 x 64 with
half the rows padded to half length, 12 hooks, torch on one thread), no hooks
/ the naive copy hook / taproute -> null alternated round by round.  Timer
hooks around every hooked module (in all three variants alike) sum the model
thread's CPU inside the hooks; the rest of its CPU per forward pass is what
the forward pays beside them (GIL handoffs, caches, the allocator).  Also
per pass: the model thread's voluntary context switches (waits: for the GIL,
as it does no I/O) and the other threads' CPU::

    python bench/hook_split_probe.py --rounds 20 > bench/profiles/hook_split_<commit>.txt
"""

from __future__ import annotations

import argparse
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import torch
from harness import fix_malloc, quantile
from inference_cost import SCHEMA, NullSink, hooked_modules, naive_hooks, probe_gpt2

from taproute.service import create_record_runtime
from taproute.service.capture import bind_modules, capture_context


def switches() -> int:
    """This thread's voluntary context switches so far."""
    status = Path(f"/proc/self/task/{threading.get_native_id()}/status").read_text()
    line = next(x for x in status.splitlines() if x.startswith("voluntary_ctxt_switches"))
    return int(line.split()[1])


def others_cpu() -> float:
    """CPU seconds of this process's threads other than this one."""
    me = str(threading.get_native_id())
    total = 0
    for tid in os.listdir("/proc/self/task"):
        if tid != me:
            total += int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0])
    return total / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--passes", type=int, default=5)
    args = parser.parse_args()
    malloc = fix_malloc("fixed")
    model, patterns, forward, ids, mask = probe_gpt2()
    keys = list(range(8))
    kept: list[Any] = []
    runtime = create_record_runtime(record_sink=NullSink(), schema=SCHEMA)
    modules = hooked_modules(model, patterns)
    inside = [0.0]
    started: dict[int, float] = {}

    def start(module: Any, _i: Any, _o: Any) -> None:
        started[id(module)] = time.thread_time()

    def end(module: Any, _i: Any, _o: Any) -> None:
        inside[0] += time.thread_time() - started[id(module)]

    def one(kind: str) -> tuple[float, float, float, float, float]:
        handles = [m.register_forward_hook(start) for m in modules]
        bindings: list[Any] = []
        if kind == "naive":
            handles += naive_hooks(model, patterns, kept)
        elif kind == "null":
            bindings = [b for p in patterns for b in bind_modules(runtime, model, p, layout="acts")]
        handles += [m.register_forward_hook(end) for m in modules]
        try:
            inside[0] = 0.0
            cpu, waits, others = time.thread_time(), switches(), others_cpu()
            with torch.inference_mode(), capture_context(keys, attention_mask=mask):
                for _ in range(args.passes):
                    forward(ids, mask)
            cpu, waits = time.thread_time() - cpu, switches() - waits
            others = others_cpu() - others
        finally:
            for handle in handles:
                handle.remove()
            for binding in bindings:
                binding.remove()
            kept.clear()
            runtime.flush()
        n = args.passes
        return cpu / n, inside[0] / n, (cpu - inside[0]) / n, waits / n, others / n

    kinds = ["none", "naive", "null"]
    samples: dict[str, list[tuple[float, ...]]] = {k: [] for k in kinds}
    for round_ in range(args.rounds + 1):  # round 0: warm-up
        for kind in kinds if round_ % 2 else kinds[::-1]:
            figures = one(kind)
            if round_:
                samples[kind].append(figures)
    runtime.close()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    print(f"commit {commit}, load average {os.getloadavg()[0]:.1f} at the end, malloc {malloc}")
    print(f"{args.rounds} rounds of {args.passes} forward passes, kinds alternated; medians\n")

    def med(kind: str, i: int) -> float:
        return quantile([s[i] for s in samples[kind]], 0.5)

    for kind in kinds:
        print(
            f"{kind:6s} model thread CPU/pass {med(kind, 0) * 1e3:7.3f} ms "
            f"({med(kind, 0) / med('none', 0):.3f}x none): inside hooks "
            f"{med(kind, 1) * 1e3:6.3f}, beside them {med(kind, 2) * 1e3:7.3f} "
            f"({med(kind, 2) / med('none', 2):.3f}x none); voluntary switches/pass "
            f"{med(kind, 3):4.1f}; other threads' CPU/pass {med(kind, 4) * 1e3:6.3f} ms"
        )


if __name__ == "__main__":
    main()
