"""Probe: a capture hook's model-thread CPU and the garbage collections it sets off.

# bench: not a script

12 hooks on identity modules returning ``(8, 1, 256)`` (a GPT-2 decode
step's hidden state, the example server's generate) and ``(8, 64, 256)``
(a prefill), bound with the writer process's shared pool (as
``serve_load.py`` runs the server), one capture context per forward pass
of the 12 modules, into a null destination.  Two variants alternate in
one process, order shuffled per round:

- ``old``: the hook path before the one-call capture: the output copied
  whole into the pooled tensor (torch views and ``copy_``), descriptors by
  ``stamped_copy``, the batch, lease and release tracked by the cyclic GC;
- ``new``: the library's path (``capture_records``, ``untrack_acyclic``,
  ``GiveBack``).

Per round: hook CPU (``time.thread_time`` per pass / 12) p50 and p99, and
the collections Python ran (``gc.callbacks``), full ones counted apart::

    python bench/hook_gc_probe.py --rounds 4 > bench/profiles/hook_gc_<commit>.txt
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import time
from typing import Any

import torch
from inference_cost import SCHEMA, NullSink

import taproute.service.capture.binding as binding
import taproute.service.capture.host_copy as host_copy
from taproute.native import stamped_copy
from taproute.service import create_record_runtime
from taproute.service.capture import bind_module, capture_context
from taproute.service.sinks.writer import SharedBufferPool

NEW_TO_HOST = host_copy.to_host
NEW_UNTRACK = binding.untrack_acyclic


def _old_to_host(
    source: Any,
    pool: Any,
    owned: bool,
    as_numpy: Any,
    plan: Any,
    output_id: int,
    keys: Any,
    step: int,
) -> Any:
    """The path before: a pooled CPU output went through the device path."""
    if not source.is_cpu or pool.cpu_outputs:
        payload, release = host_copy._pooled(source, pool)
        descriptors = stamped_copy(plan[5], output_id, time.time_ns(), keys, step)
        return descriptors, payload, release
    return NEW_TO_HOST(source, pool, owned, as_numpy, plan, output_id, keys, step)


def _variant(name: str) -> None:
    binding.to_host = _old_to_host if name == "old" else NEW_TO_HOST  # type: ignore[assignment]
    binding.untrack_acyclic = (lambda *_: None) if name == "old" else NEW_UNTRACK


class _Identity(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _run(shape: tuple[int, ...], calls: int, hooks: int = 12) -> tuple[float, float]:
    """Hook CPU per call (seconds) p50 and p99 over ``calls`` calls."""
    modules = [_Identity() for _ in range(hooks)]
    pool = SharedBufferPool()
    x = torch.randn(*shape)
    mask = torch.ones(shape[0], shape[1], dtype=torch.int64)
    per_call: list[float] = []
    try:
        with create_record_runtime(
            record_sink=NullSink(), schema=SCHEMA, max_block=0.05, wake_delay=0.1
        ) as runtime:
            for i, module in enumerate(modules):
                bind_module(runtime, module, f"h{i}", layout="acts", pool=pool)  # type: ignore[arg-type]
            with torch.inference_mode():
                for step in range(calls // hooks):
                    with capture_context(list(range(shape[0])), attention_mask=mask, step=step):
                        began = time.thread_time()
                        for module in modules:
                            module(x)
                        per_call.append((time.thread_time() - began) / hooks)
            runtime.flush()
    finally:
        pool.close()
    per_call.sort()
    return statistics.median(per_call), per_call[int(len(per_call) * 0.99)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--calls", type=int, default=6000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    collections: dict[int, list[float]] = {}
    started: list[float] = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            collections.setdefault(info["generation"], []).append(time.perf_counter() - started[0])

    gc.callbacks.append(on_gc)
    shapes = [(8, 1, 256), (8, 64, 256)]
    _run(shapes[0], 1200)  # warm-up: imports, the first full collections
    gc.collect()
    print(f"# load average at start {os.getloadavg()}; tracked objects {len(gc.get_objects())}")
    results: dict[tuple[str, tuple[int, ...]], list[tuple[float, float, int, float]]] = {}
    for _ in range(args.rounds):
        order = ["old", "new"]
        random.shuffle(order)
        for name in order:
            _variant(name)
            for shape in shapes:
                collections.clear()
                p50, p99 = _run(shape, args.calls)
                full = len(collections.get(2, []))
                gc_ms = 1e3 * sum(sum(times) for times in collections.values())
                results.setdefault((name, shape), []).append((p50, p99, full, gc_ms))
    _variant("new")
    print(f"# load average at end {os.getloadavg()}")
    print(f"# per round of {args.calls} hook calls: hook CPU p50 / p99 (us), full GCs, GC ms")
    for (name, shape), rows in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        p50 = statistics.median(r[0] for r in rows) * 1e6
        p99 = statistics.median(r[1] for r in rows) * 1e6
        print(
            f"{name:4s} {shape!s:14s} p50 {p50:6.1f} us  p99 {p99:6.1f} us  "
            f"full GCs {[r[2] for r in rows]}  GC ms {[round(r[3]) for r in rows]}"
        )


if __name__ == "__main__":
    main()
