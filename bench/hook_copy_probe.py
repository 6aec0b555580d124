"""Probe: where a capture hook should copy a CPU output to, measured inside GPT-2's forward.

# bench: not a script

Each hooked output (GPT-2 from a config, 4 layers x 256, batch 8 x 64, 12
hooks, torch on one thread) is copied by a hook into one of:

- ``fresh_pass``: a fresh array, kept until the pass ends (the naive hook);
- ``fresh_later``: a fresh array, freed five hook calls later (what capture
  does: the batch is released once the loop took it);
- ``pool_rotation``: one of 12 preallocated buffers in turn (a buffer pool
  in steady state, each buffer last written a pass ago);
- ``pool_same``: always the same preallocated buffer (a hot buffer: the floor).

Model-thread CPU time per hook call (``time.thread_time_ns``), median per
round, rounds interleaved.  Writes ``bench/profiles/hook_copy_<commit>.txt``::

    python bench/hook_copy_probe.py [--rounds 6]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time
from typing import Any

import numpy as np
import torch
from harness import RESULTS, commit
from inference_cost import hooked_modules, probe_gpt2

VARIANTS = ("fresh_pass", "fresh_later", "pool_rotation", "pool_same")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--passes", type=int, default=8)
    args = parser.parse_args()
    model, patterns, forward, ids, mask = probe_gpt2()
    modules = hooked_modules(model, patterns)
    nbytes = 8 * 64 * 256 * 4
    pool = [np.ones(nbytes, np.uint8) for _ in range(12)]
    kept: list[Any] = []
    later: collections.deque[Any] = collections.deque()
    turn = [0]

    def copy_into(kind: str, tensor: torch.Tensor) -> None:
        source = tensor.numpy()
        if kind == "fresh_pass":
            kept.append(source.copy())
        elif kind == "fresh_later":
            later.append(source.copy())
            while len(later) > 5:
                later.popleft()
        else:
            buffer = pool[turn[0] % 12] if kind == "pool_rotation" else pool[0]
            turn[0] += 1
            np.copyto(buffer.view(np.float32).reshape(source.shape), source)

    medians: dict[str, list[float]] = {kind: [] for kind in VARIANTS}
    loads = [os.getloadavg()]
    samples: list[int] = []
    started: dict[int, int] = {}
    for _ in range(args.rounds):
        for kind in VARIANTS:
            samples.clear()

            def start(mod: Any, _i: Any, _o: Any) -> None:
                started[id(mod)] = time.thread_time_ns()

            def hook(_mod: Any, _i: Any, out: Any, kind: str = kind) -> None:
                copy_into(kind, out[0] if isinstance(out, tuple) else out)

            def end(mod: Any, _i: Any, _o: Any) -> None:
                samples.append(time.thread_time_ns() - started[id(mod)])

            handles = [m.register_forward_hook(start) for m in modules]
            handles += [m.register_forward_hook(hook) for m in modules]
            handles += [m.register_forward_hook(end) for m in modules]
            with torch.inference_mode():
                for _ in range(args.passes):
                    forward(ids, mask)
                    kept.clear()
            later.clear()
            for handle in handles:
                handle.remove()
            medians[kind].append(statistics.median(samples) / 1e3)
    loads.append(os.getloadavg())
    short, dirty = commit()
    lines = [
        f"# at commit {short}{' (dirty)' if dirty else ''}: copy destination of a CPU capture, "
        "GPT-2 4 layers x 256, batch 8 x 64, 12 hooks (512 KiB each), torch 1 thread",
        f"# {args.rounds} interleaved rounds x {args.passes} passes; model-thread CPU us per "
        f"hook call, median per round; load average {loads[0]} -> {loads[1]} "
        "(2 cores shared with other jobs)",
    ]
    for kind in VARIANTS:
        values = medians[kind]
        lines.append(
            f"{kind:14s} median {statistics.median(values):7.1f}  rounds "
            + " ".join(f"{v:.1f}" for v in values)
        )
    text = "\n".join(lines) + "\n"
    out = RESULTS.parent / "profiles" / f"hook_copy_{short}.txt"
    out.write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
