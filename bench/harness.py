"""What every bench script shares: interleaved repetitions, median and spread,
the run's metadata, and one result file per script per commit.

A bench script (see bench/README.md for the convention) measures taproute and
its peers in the same process run, interleaving repetitions so that a burst of
noise on these shared machines hits every variant alike, then calls
:func:`write_result`.  That prints one JSON line and keeps the result as
``bench/results/<commit>/<script>.json`` (never overwriting: a second run of
the same commit gets ``<script>.2.json``).  ``run_all.py`` builds
``report.md`` and its charts from these files only.

Import it from a script in ``bench/`` with ``from harness import ...`` (the
scripts run as ``python bench/<script>.py``; ``bench/`` is on ``sys.path``).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.metadata
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
#: Bump when the result-file layout changes incompatibly.
SCHEMA_VERSION = 2
#: Distributions whose versions every result file records (when installed).
VERSIONED = (
    "taproute",
    "numpy",
    "trio",
    "pyarrow",
    "chdb",
    "clickhouse-connect",
    "bytewax",
    "hdrhistogram",
    "torch",
    "transformers",
    "Cython",
)


# -- the run's metadata ------------------------------------------------------


def _git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def commit() -> tuple[str, bool]:
    """(short commit, dirty): dirty when tracked files differ from the commit
    (results written by bench runs themselves do not count)."""
    short = _git("rev-parse", "--short=10", "HEAD") or "unknown"
    status = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/results")
    return short, bool(status)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def versions(extra: Iterable[str] = ()) -> dict[str, str]:
    """Installed versions of the libraries a result depends on."""
    out = {"python": platform.python_version()}
    for name in (*VERSIONED, *extra):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def metadata(params: Mapping[str, Any], *, started: float | None = None) -> dict[str, Any]:
    """Everything a reader needs to judge a figure: commit (and dirty flag),
    machine, load (at start when given, and now), versions, parameters."""
    short, dirty = commit()
    now = time.time()
    return {
        "commit": short,
        "dirty": dirty,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
        "duration_s": None if started is None else round(now - started, 2),
        "cpu_model": cpu_model(),
        "cores": os.cpu_count(),
        "affinity_cores": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else None,
        "load_average_start": _LOAD_AT_IMPORT,
        "load_average_end": load_average(),
        "platform": platform.platform(),
        "script": Path(sys.argv[0]).name,
        "argv": sys.argv[1:],
        "max_repeat": max_repeat(),
        "versions": versions(),
        "params": dict(params),
    }


_LOAD_AT_IMPORT = load_average()
_STARTED = time.time()


# -- measuring ---------------------------------------------------------------


def summary(samples: list[float]) -> dict[str, Any]:
    """Median, min, max, relative spread ((max - min) / median), quartiles and
    the raw samples."""
    if not samples:
        raise ValueError("no samples")
    ordered = sorted(samples)
    median = statistics.median(ordered)
    if len(ordered) > 1:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    else:
        q1 = q3 = ordered[0]
    return {
        "median": median,
        "min": ordered[0],
        "max": ordered[-1],
        "q1": q1,
        "q3": q3,
        "spread": (ordered[-1] - ordered[0]) / median if median else 0.0,
        "n": len(ordered),
        "samples": list(samples),
    }


def interleave(
    variants: Mapping[str, Callable[[], float]],
    *,
    repeat: int,
    warmup: int = 1,
    shuffle: bool = True,
    seed: int = 0,
    after_warmup: Callable[[], object] | None = None,
) -> dict[str, dict[str, Any]]:
    """Run every variant ``repeat`` times, round-robin (order shuffled each
    round), after ``warmup`` unrecorded rounds; each call returns one sample
    (a rate, a time).  Returns ``{variant: summary(samples)}``.
    ``after_warmup`` runs once when the warm-up rounds are done (a variant
    that also records samples of its own clears them there).

    Interleaving matters here: on shared cores, running variants in blocks
    turns a noisy minute into a fake ratio.
    """
    rng = random.Random(seed)
    names = list(variants)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(warmup + repeat):
        if round_ == warmup and after_warmup is not None:
            after_warmup()
        order = names[:]
        if shuffle:
            rng.shuffle(order)
        for name in order:
            value = variants[name]()
            if round_ >= warmup:
                samples[name].append(value)
    return {name: summary(values) for name, values in samples.items()}


#: Process CPU seconds (all threads) of the last :func:`timed_rate` body.
LAST_CPU = [0.0]


def timed_rate(count: int, body: Callable[[], object], *, min_seconds: float = 0.0) -> float:
    """``count`` (the records one call of ``body`` handles) per second of
    ``body``; its process CPU seconds go to :data:`LAST_CPU`.

    With ``min_seconds``, ``body`` is called back to back until that much
    time has passed (at least once) and the rate is over all the calls: a
    call of a millisecond or two, timed alone, measures the timer, the
    caches the previous variant left cold and whatever preempted it more
    than the call.  Every variant of a comparison gets the same rule.
    """
    cpu, started = time.process_time(), time.perf_counter()
    calls = 0
    while True:
        body()
        calls += 1
        elapsed = time.perf_counter() - started
        if elapsed >= min_seconds:
            break
    LAST_CPU[0] = (time.process_time() - cpu) / calls
    return count * calls / elapsed


def submit_rate(
    runtime: Any,
    batches: list[tuple[Any, Any]],
    *,
    record_bytes: int,
    hook: str = "vectors",
    layout: str = "vec",
) -> float:
    """Records/s of one pass of a route bench's taproute variant: ``batches``
    (``(keys, payloads)`` pairs) submitted through ``runtime`` as hook
    ``hook`` of ``layout``, then ``flush()``; descriptors are made before the
    clock starts."""
    from taproute.service import make_descriptors

    h = runtime.bind_hook(hook, layout=layout)
    layout_id = runtime.schema.layout_id(layout)
    prepared = [
        (make_descriptors(h, record_bytes, count=len(k), layout_ids=layout_id, keys=k), v)
        for k, v in batches
    ]

    def body() -> None:
        for desc, payload in prepared:
            runtime.submit_batch(desc, payload)
        runtime.flush()

    return timed_rate(sum(len(k) for k, _ in batches), body)


def quantile(samples: list[float], q: float) -> float:
    """The ``q`` quantile of ``samples`` (nearest rank, no interpolation)."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ratio(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, float]:
    """a / b for two summaries: the ratio of medians, and the range the
    per-round ratios span (samples paired by round, as interleave takes them)."""
    pairs = [x / y for x, y in zip(a["samples"], b["samples"], strict=False) if y]
    return {
        "median": a["median"] / b["median"] if b["median"] else float("nan"),
        "paired_min": min(pairs) if pairs else float("nan"),
        "paired_max": max(pairs) if pairs else float("nan"),
    }


class NullSink:
    """A destination that counts records and never reads them (async, like
    every sink).  Only for measuring the router's own floor; a destination
    standing for real work must touch the payload (``_workload.CopySink``)."""

    def __init__(self) -> None:
        self.records = 0

    async def submit(self, batch: Any) -> None:
        self.records += len(batch)

    async def flush(self) -> None:
        pass

    async def close(self) -> None:
        pass


# -- arguments and results ---------------------------------------------------


#: Set by ``run_all --max-repeat N``: every script's ``--repeat`` default is
#: capped at N (fewer repetitions, same comparisons).
MAX_REPEAT_ENV = "TAPROUTE_BENCH_MAX_REPEAT"


def max_repeat() -> int | None:
    """The cap on repetitions this run was given (None: the scripts' own)."""
    value = os.environ.get(MAX_REPEAT_ENV)
    return int(value) if value else None


def arguments(
    description: str | None, *, min_repeat: int = 1, **defaults: tuple[Any, Any]
) -> argparse.Namespace:
    """The common command line: ``--quick`` plus ``--NAME`` per keyword,
    each given as ``(full default, quick default)``.  Also ``--repeat``
    (defaults 5 / 2) unless given; its default is capped by
    :func:`max_repeat`.  The parsed namespace has ``quick``.

    ``min_repeat``: a full run repeats at least this often, whatever the
    cap or ``--repeat`` says: for a script whose target is decided by a
    median that two repetitions leave at the mercy of one noisy run (and
    that is cheap enough to repeat).  ``--quick`` is not held to it."""
    defaults.setdefault("repeat", (5, 2))
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="short run (development)")
    for name, (full, _) in defaults.items():
        kind = type(full) if full is not None else str
        if isinstance(full, list):
            parser.add_argument(f"--{name.replace('_', '-')}", type=str, default=None)
        else:
            parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None)
    args = parser.parse_args()
    cap = max_repeat()
    for name, (full, quick) in defaults.items():
        value = getattr(args, name)
        if value is None:
            value = quick if args.quick else full
            if name == "repeat" and cap is not None:
                value = min(value, cap)
        elif isinstance(full, list):
            value = [type(full[0])(v) for v in value.split(",")]
        setattr(args, name, value)
    if not args.quick:
        args.repeat = max(args.repeat, min_repeat)
    return args


def results_dir() -> Path:
    short, dirty = commit()
    return RESULTS / (short + ("-dirty" if dirty else ""))


def write_result(
    name: str,
    *,
    params: Mapping[str, Any],
    quick: bool,
    comparisons: list[dict[str, Any]] | None = None,
    tables: list[dict[str, Any]] | None = None,
    curves: list[dict[str, Any]] | None = None,
    targets: list[dict[str, Any]] | None = None,
    notes: list[str] | None = None,
    raw: Mapping[str, Any] | None = None,
    title: str | None = None,
    description: str | None = None,
) -> Path:
    """Print the result as one JSON line and keep it under
    ``bench/results/<commit>[-dirty]/<name>[.quick][.N].json``; never
    overwrites.  The sections are what ``report.md`` renders (see
    bench/README.md): ``comparisons`` (taproute vs a peer, same run),
    ``tables``, ``curves`` (charted), ``targets``, ``notes`` (sentences
    the script formats from its own figures), ``raw`` (samples and anything
    else worth keeping)."""
    record = {
        "bench": name,
        "schema": SCHEMA_VERSION,
        "quick": quick,
        "title": title or name,
        "description": description or "",
        "meta": metadata(params, started=_STARTED),
        "comparisons": comparisons or [],
        "tables": tables or [],
        "curves": curves or [],
        "targets": targets or [],
        "notes": notes or [],
        "raw": dict(raw or {}),
    }
    text = json.dumps(record, default=_jsonable)
    print(text, flush=True)
    folder = results_dir()
    folder.mkdir(parents=True, exist_ok=True)
    stem = name + (".quick" if quick else "")
    path = folder / f"{stem}.json"
    n = 2
    while path.exists():
        path = folder / f"{stem}.{n}.json"
        n += 1
    path.write_text(json.dumps(record, indent=1, default=_jsonable) + "\n")
    return path


def _jsonable(value: Any) -> Any:
    try:
        import numpy as np

        if isinstance(value, np.generic):
            return value.item()
        if isinstance(value, np.ndarray):
            return value.tolist()
    except ImportError:
        pass
    raise TypeError(f"not JSON-serialisable: {type(value).__name__}")


def comparison(
    what: str,
    taproute: Mapping[str, Any],
    peer: Mapping[str, Any],
    *,
    taproute_label: str,
    peer_label: str,
    unit: str,
    higher_is_better: bool = True,
) -> dict[str, Any]:
    """One row of the report's main table: taproute against a peer measured
    in the same run, with the ratio (taproute / peer) and who wins."""
    r = ratio(taproute, peer)
    better = r["median"] >= 1 if higher_is_better else r["median"] <= 1
    return {
        "what": what,
        "unit": unit,
        "higher_is_better": higher_is_better,
        "taproute": {"label": taproute_label, **_short(taproute)},
        "peer": {"label": peer_label, **_short(peer)},
        "ratio": r,
        "taproute_wins": better,
    }


def _short(s: Mapping[str, Any]) -> dict[str, Any]:
    return {k: s[k] for k in ("median", "min", "max", "spread", "n") if k in s}


def target(name: str, met: bool, detail: str) -> dict[str, Any]:
    """A stated target and whether this run met it (``detail`` gives the figures)."""
    return {"name": name, "met": bool(met), "detail": detail}


def fmt(value: float) -> str:
    """A figure for prose: thousands separators above 100, 3 significant digits below."""
    if value != value:  # NaN
        return "n/a"
    if abs(value) >= 1e6:
        return f"{value / 1e6:.3g} M"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}"


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
    return [
        f"{e.tsub:8.3f}s own {e.ttot:8.3f}s cum {e.ncall:>8} calls  "
        f"{Path(e.module).name}:{e.lineno}({e.name})"
        for e in list(stats)[:limit]
    ]


# -- the previous interface, until every script has moved to write_result -----


def measure(run: Callable[[], float], *, repeat: int = 5, warmup: int = 1) -> dict[str, Any]:
    """Deprecated (blocks, not interleaved): use :func:`interleave`."""
    for _ in range(warmup):
        run()
    return summary([run() for _ in range(repeat)])


def report(name: str, figures: dict[str, Any]) -> dict[str, Any]:
    """Deprecated: use :func:`write_result`.  Prints one JSON line and keeps
    it, with the run's metadata, under the commit's results folder."""
    record = {"bench": name, "meta": metadata({}), **figures}
    print(json.dumps(record, default=_jsonable))
    folder = results_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.legacy.json"
    n = 2
    while path.exists():
        path = folder / f"{name}.legacy.{n}.json"
        n += 1
    path.write_text(json.dumps(record, indent=1, default=_jsonable) + "\n")
    # The old, overwritten location, read by the old report until it is replaced.
    (RESULTS / f"{name}.json").write_text(json.dumps(record, indent=2, default=_jsonable) + "\n")
    return record


def profile_top(run: Callable[[], object], limit: int = 8) -> list[str]:
    """Deprecated: use :func:`profile_threads`."""
    return profile_threads(run, limit)


def targets_report(targets: dict[str, bool]) -> dict[str, str]:
    """Deprecated: use :func:`target`."""
    return {name: "met" if ok else "MISSED" for name, ok in targets.items()}


# -- the process's allocator -------------------------------------------------

#: glibc's mallopt parameters: the size from which malloc maps memory for an
#: allocation of its own, and how much free memory the heap's top keeps.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def pin_apart(model_cpus: set[int]) -> set[int]:
    """Pin the calling thread to ``model_cpus`` and every other thread of this
    process and of its child processes (a writer process) to the other CPUs;
    returns those.  Threads started later inherit their starter's CPUs, so a
    loop thread pinned here takes its worker threads with it; call again
    before each timed run to catch threads started in between.

    What a serving deployment does when it gives the model thread a core of
    its own: the capture's threads then compete with each other, not with
    the model, for the rest.
    """
    others = set(os.sched_getaffinity(0) | set(range(os.cpu_count() or 1))) - model_cpus
    if not others:
        raise SystemExit(f"pinning: no CPU left beside {sorted(model_cpus)}")
    me = threading.get_native_id()
    os.sched_setaffinity(0, model_cpus)  # this thread only (Linux: a tid)
    pids = [os.getpid()]
    try:
        import psutil

        pids += [child.pid for child in psutil.Process().children(recursive=True)]
    except ImportError:
        pass
    for pid in pids:
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in tids:
            if tid == me:
                continue
            with contextlib.suppress(OSError):  # ended between listing and pinning
                os.sched_setaffinity(tid, others)
    return others


def set_switch_interval(ms: float) -> float:
    """Set Python's switch interval to ``ms`` milliseconds (0: leave Python's
    own, 5 ms); returns the interval in effect, in ms, for the result's
    parameters.  How long a thread that wants the GIL waits before asking
    its holder to let go: a process-wide setting that the server (here the
    bench) chooses, for taproute and the peer alike."""
    import sys

    if ms < 0:
        raise SystemExit(f"--switch-interval-ms must be 0 or more, not {ms}")
    if ms:
        sys.setswitchinterval(ms / 1000)
    return sys.getswitchinterval() * 1000


def fix_malloc(mode: str) -> str:
    """Fix glibc's mmap and trim thresholds (``mode`` "fixed") or leave them
    ("default"); returns what was done, for the result's parameters.

    By default glibc moves both thresholds with the sizes freed, so whether
    an allocation of a forward pass takes fresh pages (page faults, kernel
    time on the model's thread) depends on what ran before: measured here
    with GPT-2, the model thread's kernel time per forward varied from 0 to
    11 ms between rounds of one variant and between processes, with no
    hooks at all, against an effect to measure of about 0.4 ms (1 point).
    Fixed thresholds (32 MiB, 256 MiB: as PyTorch CPU tuning guides set, or
    jemalloc/tcmalloc) leave every variant, the reference included, without
    that noise.  Threads other than the main one get it worst: their arenas
    give freed pages back at once, so a numpy function allocating a few MiB
    per call took about 100,000 page faults per 98 calls in a worker thread
    (1.3-1.4x its CPU time on the main thread; stateful_vs_bytewax.py,
    bench/profiles/stateful_route_*.txt) and none on the main thread.
    """
    if mode == "default":
        return "glibc defaults (dynamic thresholds)"
    if mode != "fixed":
        raise SystemExit(f"--malloc must be 'fixed' or 'default', not {mode!r}")
    try:
        libc = ctypes.CDLL("libc.so.6")
        mmap_set = libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)
        trim_set = libc.mallopt(_M_TRIM_THRESHOLD, 256 << 20)
    except (OSError, AttributeError):
        return "unchanged (no glibc mallopt)"
    if not (mmap_set and trim_set):
        return "unchanged (mallopt refused)"
    return "fixed: mmap threshold 32 MiB, trim threshold 256 MiB"
