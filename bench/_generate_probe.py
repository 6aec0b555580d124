"""Where serve_load's generate capture cost lands, without HTTP: the example
server's greedy decode (``Models.generate``, batches of 16 requests, 16 new
tokens) run on this thread, in interleaved blocks per variant, measuring per
batch the model thread's wall and CPU time, its waits (voluntary context
switches: it does no I/O, so it waits for the GIL) and the CPU of every
other thread of this process.

    python bench/_generate_probe.py [--variants off,naive,null,raw,on] [--rounds 8]

Variants (each its own model, built alike, same seed):

- ``off``: no hooks (the reference);
- ``naive``: the hook a user writes first on the same modules,
  ``output.detach().cpu().numpy().copy()`` kept in a list (persists nothing);
- ``null``: taproute's hooks on the same modules into a runtime whose
  destination counts records and reads nothing (no routes);
- ``raw``: the example server's capture with only its ``raw`` route (hooks
  copy into the writer process's shared memory; the loop forwards
  descriptors; chDB inserts in the writer process);
- ``on``: the example server's capture as it ships (``raw``, stateless
  ``head_norms``, stateful ``request_summary``), writer process.

Each capturing variant is flushed after its block (outside the timing), so
no block inherits another's backlog.  A probe for the profiles, not a
benchmark with targets (``serve_load.py`` is that).
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import bench.inference_server as server
import bench.server_capture as server_capture
from bench.harness import NullSink
from bench.inference_server import Capture, GenerateRequest, Models, ServerConfig

PATTERNS = ("transformer.h.?", "transformer.h.?.attn.c_attn")
BATCH = 16
NEW_TOKENS = 16


def waits(tid: int) -> int:
    with open(f"/proc/self/task/{tid}/status") as status:
        for line in status:
            if line.startswith("voluntary_ctxt_switches"):
                return int(line.split()[1])
    return 0


def build(variant: str, data: Path) -> tuple[Models, Any]:
    """A model for ``variant`` and what must be flushed / closed (or None)."""
    models = Models(server.Gpt2Size(), 0)
    if variant == "off":
        return models, None
    if variant == "naive":
        kept: list[Any] = []

        def copy(_module: Any, _inputs: Any, output: Any) -> None:
            tensor = output[0] if type(output) is tuple else output
            kept.append(tensor.detach().cpu().numpy().copy())

        for name, module in models.gpt2.named_modules():
            if any(fnmatch.fnmatchcase(name, p) for p in PATTERNS):
                module.register_forward_hook(copy)
        return models, kept
    if variant == "null":
        from taproute.service import create_record_runtime
        from taproute.service.capture import bind_modules, capture_context

        runtime = create_record_runtime(
            record_sink=NullSink(), schema=server_capture.SCHEMA, wake_delay=0.1
        )
        for pattern in PATTERNS:
            bind_modules(runtime, models.gpt2, pattern, layout="activations", prefix="gpt2.")
        models.capture = capture_context
        return models, runtime
    if variant in ("raw", "on"):
        every = server_capture.routes
        if variant == "raw":
            server.routes = lambda hooks, destination="clickhouse": server_capture.RoutingConfig(
                [every(hooks, destination).routes[0]]
            )
        try:
            capture = Capture(models, ServerConfig(writer="process", data=data / variant))
        finally:
            server.routes = every
        return models, capture.runtime
    raise SystemExit(f"unknown variant {variant!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="off,naive,null,raw,on")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--block", type=int, default=4, help="batches per block")
    args = parser.parse_args()
    torch.set_num_threads(1)
    variants = args.variants.split(",")
    tid = threading.get_native_id()
    data = Path(tempfile.mkdtemp(prefix="generate-probe-"))
    setups = {v: build(v, data) for v in variants}
    rng = random.Random(0)
    ids = iter(range(1, 1 << 40))

    def batch() -> list[GenerateRequest]:
        return [
            GenerateRequest(
                id=next(ids),
                ids=tuple(rng.randrange(1000, 20000) for _ in range(rng.randrange(8, 24))),
                max_new_tokens=NEW_TOKENS,
            )
            for _ in range(BATCH)
        ]

    def settle(held: Any) -> None:
        if isinstance(held, list):
            held.clear()
        elif held is not None:
            held.flush()

    def clocks() -> tuple[float, float, int, float]:
        return time.thread_time(), time.perf_counter(), waits(tid), time.process_time()

    for models, held in setups.values():  # warm up
        models.generate(batch())
        settle(held)
    figures: dict[str, dict[str, list[float]]] = {
        v: {"wall": [], "cpu": [], "waits": [], "other": []} for v in variants
    }
    load = [os.getloadavg()[0]]
    for r in range(args.rounds):
        for v in variants if r % 2 == 0 else variants[::-1]:
            models, held = setups[v]
            c0, w0, k0, p0 = clocks()
            for _ in range(args.block):
                models.generate(batch())
            c1, w1, k1, p1 = clocks()
            f = figures[v]
            f["wall"].append((w1 - w0) / args.block * 1e3)
            f["cpu"].append((c1 - c0) / args.block * 1e3)
            f["waits"].append((k1 - k0) / args.block)
            f["other"].append(((p1 - p0) - (c1 - c0)) / args.block * 1e3)
            settle(held)
    load.append(os.getloadavg()[0])
    base = {k: statistics.median(figures[variants[0]][k]) for k in ("wall", "cpu")}
    print(
        f"per batch of {BATCH} requests x {NEW_TOKENS} new tokens, median of {args.rounds} "
        f"interleaved blocks of {args.block}; load average {load[0]:.2f} -> {load[1]:.2f}"
    )
    for v in variants:
        m = {k: statistics.median(x) for k, x in figures[v].items()}
        print(
            f"  {v:6s} wall {m['wall']:6.1f} ms ({m['wall'] / base['wall']:.3f}x, "
            f"spread {min(figures[v]['wall']):.0f}-{max(figures[v]['wall']):.0f})  "
            f"model CPU {m['cpu']:6.1f} ms ({m['cpu'] / base['cpu']:.3f}x)  "
            f"waits {m['waits']:5.1f}  other threads' CPU {m['other']:5.1f} ms"
        )
    for _models, held in setups.values():
        if held is not None and not isinstance(held, list):
            held.close()


if __name__ == "__main__":
    main()
