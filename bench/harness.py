"""What every bench script shares: warm-up, repetitions, median and spread,
one JSON line out, and the last result kept under bench/results/.

Figures are compared with a peer measured in the same run (ratios), because
these machines are shared and noisy.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


class NullSink:
    """A destination that counts records and does nothing else (async, like every sink)."""

    def __init__(self) -> None:
        self.records = 0

    async def submit(self, batch: Any) -> None:
        self.records += len(batch)

    async def flush(self) -> None:
        pass

    async def close(self) -> None:
        pass


def measure(run: Callable[[], float], *, repeat: int = 5, warmup: int = 1) -> dict[str, float]:
    """Call ``run`` (which returns a rate, e.g. records/s) and summarise.

    Returns median, min, max and the relative spread ((max-min)/median).
    """
    for _ in range(warmup):
        run()
    rates = [run() for _ in range(repeat)]
    median = statistics.median(rates)
    return {
        "median": median,
        "min": min(rates),
        "max": max(rates),
        "spread": (max(rates) - min(rates)) / median if median else 0.0,
    }


def timed_rate(count: int, body: Callable[[], None]) -> float:
    """``count`` divided by the seconds ``body`` took."""
    started = time.perf_counter()
    body()
    return count / (time.perf_counter() - started)


def report(name: str, figures: dict[str, Any]) -> dict[str, Any]:
    """Print one JSON line and keep it as bench/results/<name>.json."""
    record = {
        "bench": name,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        **figures,
    }
    line = json.dumps(record, sort_keys=False)
    print(line)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def profile_top(run: Callable[[], object], limit: int = 8) -> list[str]:
    """What dominates one call of ``run``: the top functions by own time (cProfile).

    Threads other than the caller's are not profiled; the routing loop thread
    shows up as time spent waiting in the caller.
    """
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    try:
        run()
    finally:
        profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out).sort_stats("tottime")
    lines = []
    for (filename, line, name), (_, calls, own, cumulative, _) in list(stats.stats.items()):
        lines.append(
            (
                own,
                f"{own:8.3f}s own {cumulative:8.3f}s cum {calls:>8} calls  "
                f"{Path(filename).name}:{line}({name})",
            )
        )
    lines.sort(reverse=True)
    return [text for _, text in lines[:limit]]


def profile_threads(run: Callable[[], object], limit: int = 10) -> list[str]:
    """What dominates one call of ``run`` across *all* threads (the routing
    loop's included): yappi, CPU clock, top functions by own time."""
    import yappi

    yappi.clear_stats()
    yappi.set_clock_type("cpu")
    yappi.start(builtins=True)
    try:
        run()
    finally:
        yappi.stop()
    stats = yappi.get_func_stats()
    stats.sort("tsub", "desc")
    lines = []
    for entry in list(stats)[:limit]:
        lines.append(
            f"{entry.tsub:8.3f}s own {entry.ttot:8.3f}s cum {entry.ncall:>8} calls  "
            f"{Path(entry.module).name}:{entry.lineno}({entry.name})"
        )
    return lines


def targets_report(targets: dict[str, bool]) -> dict[str, str]:
    """``{"name": "met" | "MISSED"}`` for a JSON line."""
    return {name: "met" if ok else "MISSED" for name, ok in targets.items()}
