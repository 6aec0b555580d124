"""Hook hold time: taproute hooks waking the loop per call vs deferring the
wake-up, next to the naive copy hook, interleaved in one process.

GPT-2 from a config (random weights), 12 hooks, torch on one thread, into a
runtime whose destination counts records.  Each round runs a few forward
passes with one variant and records, per hook call, the model thread's wall
and CPU time (``time.thread_time``) between the hooked module returning and
the measured hook returning, and the model thread's CPU time per forward.
CPU time is the figure to read on a loaded machine: wall time there is
mostly other processes.  Variants:

- ``naive``: ``output.detach().cpu().numpy().copy()`` appended to a list;
- ``wake_each``: taproute with ``wake_delay = 0`` (every hook call that finds
  the loop idle wakes it: the behaviour before the deferred wake-up);
- ``deferred``: taproute as shipped (one wake-up per ``wake_delay``).

glibc's malloc thresholds are fixed for the run unless ``--malloc default``
(``inference_cost.fix_malloc``: page faults otherwise vary per round).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from harness import arguments, comparison, fmt, interleave, quantile, target, write_result
from inference_cost import SCHEMA, NullSink, fix_malloc, gpt2, hooked_modules, naive_hooks

from taproute.service import create_record_runtime
from taproute.service.capture import bind_modules, capture_context
from taproute.service.host.ingress import WAKE_DELAY_S


def main() -> None:
    args = arguments(
        __doc__.splitlines()[0],
        repeat=(9, 3),
        passes=(5, 2),
        batch=(8, 8),
        tokens=(64, 32),
        layers=(4, 2),
        hidden=(256, 128),
        malloc=("fixed", "fixed"),
    )
    args.malloc = fix_malloc(args.malloc)
    torch.set_num_threads(1)
    model, patterns, forward = gpt2(args.layers, args.hidden)
    torch.manual_seed(1)
    ids = torch.randint(3, 1000, (args.batch, args.tokens))
    mask = torch.ones(args.batch, args.tokens, dtype=torch.long)
    mask[::2, args.tokens // 2 :] = 0
    keys = list(range(args.batch))
    runtime = create_record_runtime(record_sink=NullSink(), schema=SCHEMA)
    ingress = runtime.offer_batch.__self__._ingress  # type: ignore[attr-defined]
    modules = hooked_modules(model, patterns)
    kept: list[Any] = []
    walls: dict[str, list[float]] = {"naive": [], "wake_each": [], "deferred": []}
    cpus: dict[str, list[float]] = {name: [] for name in walls}

    def variant(kind: str) -> Any:
        def run() -> float:
            started: dict[int, tuple[float, float]] = {}

            def start(mod: Any, _i: Any, _o: Any) -> None:
                started[id(mod)] = (time.perf_counter(), time.thread_time())

            def end(mod: Any, _i: Any, _o: Any) -> None:
                wall, cpu = started[id(mod)]
                walls[kind].append(time.perf_counter() - wall)
                cpus[kind].append(time.thread_time() - cpu)

            handles = [m.register_forward_hook(start) for m in modules]
            bindings: list[Any] = []
            if kind == "naive":
                handles += naive_hooks(model, patterns, kept)
            else:
                ingress.wake_delay = 0.0 if kind == "wake_each" else WAKE_DELAY_S
                bindings = [
                    b for p in patterns for b in bind_modules(runtime, model, p, layout="acts")
                ]
            handles += [m.register_forward_hook(end) for m in modules]
            try:
                cpu = time.thread_time()
                with torch.inference_mode(), capture_context(keys, attention_mask=mask):
                    for _ in range(args.passes):
                        forward(ids, mask)
                        kept.clear()
                return (time.thread_time() - cpu) / args.passes
            finally:
                for handle in handles:
                    handle.remove()
                for binding in bindings:
                    binding.remove()
                runtime.flush()

        return run

    def forget_warmup() -> None:  # hook calls of the warm-up round are not samples
        for samples in (*walls.values(), *cpus.values()):
            samples.clear()

    results = interleave(
        {k: variant(k) for k in walls}, repeat=args.repeat, warmup=1, after_warmup=forget_warmup
    )
    runtime.close()
    holds = {
        kind: {
            "cpu_p50": quantile(cpus[kind], 0.5),
            "cpu_p99": quantile(cpus[kind], 0.99),
            "wall_p50": quantile(walls[kind], 0.5),
            "wall_p99": quantile(walls[kind], 0.99),
            "calls": len(cpus[kind]),
        }
        for kind in walls
    }
    comparisons = [
        comparison(
            f"model-thread CPU per forward, taproute ({kind}) vs naive copy hook",
            results[kind],
            results["naive"],
            taproute_label=f"taproute {kind}",
            peer_label="naive copy hook",
            unit="CPU s per forward",
            higher_is_better=False,
        )
        for kind in ("wake_each", "deferred")
    ]
    rows = [
        [
            kind,
            fmt(holds[kind]["cpu_p50"] * 1e6),
            fmt(holds[kind]["cpu_p99"] * 1e6),
            fmt(holds[kind]["wall_p50"] * 1e6),
            fmt(holds[kind]["wall_p99"] * 1e6),
            fmt(results[kind]["median"] * 1e3),
        ]
        for kind in walls
    ]
    naive, deferred = holds["naive"], holds["deferred"]
    write_result(
        "hook_wakeup",
        title="Hook hold time: deferred wake-up vs a wake-up per hook call",
        description=__doc__.split("\n\n")[0],
        params=vars(args),
        quick=args.quick,
        comparisons=comparisons,
        tables=[
            {
                "title": "Hook hold per call (us) and model-thread CPU per forward (ms)",
                "columns": ["variant", "CPU p50", "CPU p99", "wall p50", "wall p99", "CPU ms/fwd"],
                "rows": rows,
            }
        ],
        targets=[
            target(
                "hook hold p99 (model-thread CPU) <= 2x the naive hook's",
                deferred["cpu_p99"] <= 2 * naive["cpu_p99"],
                f"{fmt(deferred['cpu_p99'] * 1e6)} us vs {fmt(naive['cpu_p99'] * 1e6)} us",
            )
        ],
        notes=[
            "Hold = model thread between the hooked module returning and the measured hook "
            "returning; CPU via time.thread_time. Wall figures on a shared, loaded machine "
            "are mostly time the thread was not scheduled.",
            f"malloc: {args.malloc} (inference_cost.fix_malloc).",
        ],
        raw={"holds": holds, "cpu_samples": cpus, "wall_samples": walls},
    )


if __name__ == "__main__":
    main()
