"""Where a capture's cost lands, from an ``inference_cost`` result file.

Per variant and model, how much the forward pass grew over no hooks (wall),
and beside it what could have made it grow: the model thread's own CPU
growth, the CPU of the model process's other threads (they take the GIL the
model thread needs between torch operations) and of the writer processes
(they compete for cores only); and the model thread's waits (for the GIL:
it does no I/O) and preemptions per forward.  Times in ms per forward,
medians of the run's interleaved repetitions.

    python bench/_cost_split.py bench/results/<commit>/inference_cost.json

Prints a text profile (kept as ``bench/profiles/cost_split_<commit>.txt``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

VARIANTS = (
    "naive",
    "taproute_null",
    "taproute_chdb",
    "taproute_chdb_process",
    "taproute_routes_chdb",
    "taproute_routes_process",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result", type=Path)
    args = parser.parse_args()
    text = args.result.read_text().strip()
    try:
        result = json.loads(text)  # a result file
    except json.JSONDecodeError:
        result = json.loads(text.splitlines()[-1])  # a script's stdout: its last line
    meta = result.get("meta", {})
    print(f"# {__doc__.splitlines()[0]}")
    print(
        f"# from {args.result}: commit {meta.get('commit')}"
        f"{' (dirty)' if meta.get('dirty') else ''}, {meta.get('cores')} cores,"
        f" load average {meta.get('load_average_start')} -> {meta.get('load_average_end')},"
        f" argv {meta.get('argv')}"
    )
    print("# ms per forward; d = minus the no-hooks reference's; other = the model")
    print("# process's other threads; writers = the writer processes")
    for model, measured in result["raw"].items():
        results = measured["results"]
        model_cpu = measured["model_cpu"]
        other = measured.get("other_threads_cpu")
        writers = measured.get("writer_processes_cpu")
        if other is None or writers is None:
            raise SystemExit(f"{args.result}: no CPU split (made before e430e52)")
        wall0 = results["none"]["median"] * 1e3
        cpu0 = model_cpu["none"]["median"] * 1e3
        other0 = other["none"]["median"] * 1e3
        print(f"\n{model}: no hooks {wall0:.1f} ms wall, model thread {cpu0:.1f} ms CPU,")
        print(f"  other threads {other0:.1f} ms CPU over the reference's own runs")
        waits = measured.get("model_thread_waits", {})
        preempted = measured.get("model_thread_preempted", {})
        print(
            f"  {'variant':26s} {'d wall':>7s} {'d model CPU':>12s} {'d other':>8s}"
            f" {'writers':>8s} {'d wall-d CPU-d other':>25s} {'waits':>6s} {'preempted':>10s}"
        )
        for variant in VARIANTS:
            wall = results[variant]["median"] * 1e3 - wall0
            cpu = model_cpu[variant]["median"] * 1e3 - cpu0
            rest = other[variant]["median"] * 1e3 - other0
            write = writers[variant]["median"] * 1e3
            waited = waits.get(variant, {}).get("median", float("nan"))
            taken = preempted.get(variant, {}).get("median", float("nan"))
            print(
                f"  {variant:26s} {wall:7.1f} {cpu:12.1f} {rest:8.1f} {write:8.1f}"
                f" {wall - cpu - rest:25.1f} {waited:6.1f} {taken:10.1f}"
            )


if __name__ == "__main__":
    main()
