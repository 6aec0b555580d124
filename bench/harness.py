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
