"""Probe: which hook calls set the hold-time p99 (a per-call trace).

# bench: not a script

GPT-2 from a config (4 layers x 256, batch 8 x 64, half the rows padded to
half length), 12 hooks, torch on one thread, rounds as
``inference_cost.hold_times`` makes them: each round binds the hooks afresh,
opens one capture context and runs a few forward passes; naive copy hook and
taproute -> null alternate round by round.  Every hook call's hold (model
thread CPU, ``time.thread_time``, and wall) is kept with its place: round,
pass, hook.  The summary says how the calls of each place compare::

    python bench/hook_trace.py --rounds 20 > bench/profiles/hook_p99_<commit>.txt

glibc's malloc thresholds are fixed as in the benches (``--malloc default``
leaves them dynamic: then page faults add kernel time to some calls).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from collections.abc import Iterable
from typing import Any

import torch
from harness import quantile
from inference_cost import SCHEMA, NullSink, fix_malloc, hooked_modules, naive_hooks, probe_gpt2

from taproute.service import create_record_runtime
from taproute.service.capture import bind_modules, capture_context

#: One hook call: (variant, round, pass, call order in the pass, CPU s, wall s).
Call = tuple[str, int, int, int, float, float]


def trace(rounds: int, passes: int, contexts: int, new_masks: bool = False) -> list[Call]:
    model, patterns, forward, ids, mask = probe_gpt2()
    keys = list(range(8))
    modules = hooked_modules(model, patterns)
    calls: list[Call] = []
    kept: list[Any] = []
    runtime = create_record_runtime(record_sink=NullSink(), schema=SCHEMA)
    started: dict[int, tuple[float, float]] = {}
    where: list[Any] = ["", 0, 0, 0]  # variant, round, pass, calls so far in the pass

    def start(mod: Any, _i: Any, _o: Any) -> None:
        started[id(mod)] = (time.perf_counter(), time.thread_time())

    def end(mod: Any, _i: Any, _o: Any) -> None:
        wall, cpu = started[id(mod)]
        cpu_s, wall_s = time.thread_time() - cpu, time.perf_counter() - wall
        calls.append((where[0], where[1], where[2], where[3], cpu_s, wall_s))
        where[3] += 1

    def one_round(kind: str, round_: int) -> None:
        handles = [m.register_forward_hook(start) for m in modules]
        bindings: list[Any] = []
        if kind == "naive":
            handles += naive_hooks(model, patterns, kept)
        else:
            bindings = [b for p in patterns for b in bind_modules(runtime, model, p, layout="acts")]
        handles += [m.register_forward_hook(end) for m in modules]
        try:
            with torch.inference_mode():
                for c in range(contexts):
                    given = mask
                    if new_masks:  # a mask no context had before: no plan to share
                        given = mask.clone()
                        given[1, 63 - (round_ * contexts + c) % 60 :] = 0
                    with capture_context(keys, attention_mask=given):
                        for p in range(passes):
                            where[:] = [kind, round_, c * passes + p, 0]
                            forward(ids, given)
                            kept.clear()
        finally:
            for handle in handles:
                handle.remove()
            for binding in bindings:
                binding.remove()
            runtime.flush()

    for round_ in range(rounds + 1):  # round 0: warm-up, dropped below
        for kind in ("naive", "taproute") if round_ % 2 else ("taproute", "naive"):
            one_round(kind, round_)
    runtime.close()
    return [c for c in calls if c[1] > 0]


def _us(samples: Iterable[float]) -> str:
    values = list(samples)
    if not values:
        return "-"
    return (
        f"n={len(values):4d} p50 {quantile(values, 0.5) * 1e6:6.0f}  "
        f"p99 {quantile(values, 0.99) * 1e6:6.0f}  max {max(values) * 1e6:6.0f}"
    )


def summarize(calls: list[Call], passes: int) -> str:
    out = []
    for kind in ("naive", "taproute"):
        mine = [c for c in calls if c[0] == kind]
        cpu = [c[4] for c in mine]
        out.append(f"{kind}: all calls, model-thread CPU us: {_us(cpu)}")
        groups = {
            "first call of a round (after the other variant's round)": [
                c[4] for c in mine if c[2] == 0 and c[3] == 0
            ],
            "first call of a later context of the round": [
                c[4] for c in mine if c[2] and c[2] % passes == 0 and c[3] == 0
            ],
            "other calls of a binding's first pass": [c[4] for c in mine if c[2] == 0 and c[3] > 0],
            "first call of a later pass of a context": [
                c[4] for c in mine if c[2] % passes and c[3] == 0
            ],
            "every other call": [c[4] for c in mine if c[2] and c[3] > 0],
        }
        for label, values in groups.items():
            out.append(f"  {label:55s} {_us(values)}")
        ranked = sorted(mine, key=lambda c: -c[4])
        top = len(cpu) // 100 + 1
        out.append(f"  the {top} slowest calls (the p99 and above): (round, pass, call) CPU us")
        out.append(
            "    " + ", ".join(f"({c[1]},{c[2]},{c[3]}) {c[4] * 1e6:.0f}" for c in ranked[:top])
        )
        out.append(f"  all calls, wall us: {_us(c[5] for c in mine)}")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--passes", type=int, default=4, help="forward passes per context")
    parser.add_argument("--contexts", type=int, default=1, help="capture contexts per round")
    parser.add_argument(
        "--new-masks", action="store_true", help="every context a mask not seen before"
    )
    parser.add_argument(
        "--malloc", default="fixed", help="glibc thresholds: fixed or default (fix_malloc)"
    )
    args = parser.parse_args()
    malloc = fix_malloc(args.malloc)
    load = os.getloadavg()
    calls = trace(args.rounds, args.passes, args.contexts, args.new_masks)
    head = subprocess.run(
        ["git", "rev-parse", "--short=10", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    print(
        f"# hook_trace.py --rounds {args.rounds} --passes {args.passes} --contexts "
        f"{args.contexts}{' --new-masks' if args.new_masks else ''} --malloc {args.malloc} "
        f"at {head}; load average {load} -> {os.getloadavg()}; malloc {malloc}"
    )
    print(summarize(calls, args.passes), end="")


if __name__ == "__main__":
    main()
