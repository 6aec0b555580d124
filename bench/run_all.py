"""Run every bench script, each in a fresh process, then write
``bench/results/report.md`` with PNG charts: every figure beside its peer and
its target, misses said plainly with the profile of what dominates.

    python -m bench            # or: python bench/run_all.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

#: (script, normal arguments, --quick arguments)
SCRIPTS: list[tuple[str, list[str], list[str]]] = [
    ("route_throughput.py", [], ["--repeat", "2", "--batches", "100", "--gib", "0.25"]),
    ("fanout_peers.py", [], ["--repeat", "2", "--batches", "100"]),
    (
        "stateful_vs_bytewax.py",
        [],
        ["--repeat", "1", "--records", "50000", "--bytewax-records", "20000"],
    ),
    ("clickhouse_parity.py", [], ["--repeat", "1", "--batches", "16"]),
    ("latency.py", [], ["--seconds", "2"]),
    ("scaling.py", [], ["--repeat", "1", "--batches", "40"]),
    ("overload_soak.py", [], ["--duration", "4"]),
]


def run_scripts(quick: bool) -> dict[str, float]:
    seconds = {}
    for script, normal, fast in SCRIPTS:
        started = time.monotonic()
        print(f"== {script}", flush=True)
        subprocess.run(
            [sys.executable, str(HERE / script), *(fast if quick else normal)],
            check=True,
            stderr=subprocess.DEVNULL,
        )
        seconds[script] = time.monotonic() - started
    return seconds


def load(name: str) -> dict[str, Any]:
    return json.loads((RESULTS / f"{name}.json").read_text())


def _bar_chart(
    path: Path,
    title: str,
    labels: list[str],
    values: list[float],
    unit: str,
    log: bool = False,
    target: float | None = None,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    colors = ["#2b6cb0" if label.startswith("taproute") else "#a0aec0" for label in labels]
    ax.barh(labels, values, color=colors)
    if log:
        ax.set_xscale("log")
    if target is not None:
        ax.axvline(target, color="#c53030", linestyle="--", label="target")
        ax.legend(loc="lower right")
    ax.set_xlabel(unit)
    ax.set_title(title)
    for i, value in enumerate(values):
        ax.text(value, i, f" {value:,.3g}", va="center", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def charts() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rt, fo, sb = load("route_throughput"), load("fanout_peers"), load("stateful_vs_bytewax")
    _bar_chart(
        RESULTS / "throughput.png",
        "Records/s, same records, same run (blue: taproute)",
        [
            "taproute forward",
            "plain dict loop (1 route)",
            "taproute fan-out x3",
            "dict loop fan-out x3",
            "asyncio queues fan-out x3",
            "taproute stateful mean",
            "Bytewax stateful_map",
        ],
        [
            rt["forward_records_per_s"]["median"],
            rt["plain_loop_records_per_s"]["median"],
            fo["taproute_records_per_s"]["median"],
            fo["dict_loop_records_per_s"]["median"],
            fo["asyncio_queues_records_per_s"]["median"],
            sb["taproute_records_per_s"]["median"],
            sb["bytewax_records_per_s"]["median"],
        ],
        "records/s (log scale)",
        log=True,
    )
    lat = load("latency")
    fig, ax = plt.subplots(figsize=(7, 3.2))
    names = ["p50_us", "p99_us", "p99_9_us"]
    for offset, mode in ((-0.2, "forward"), (0.2, "stateless")):
        ax.bar(
            [i + offset for i in range(3)],
            [lat[mode][n] / 1000 for n in names],
            width=0.4,
            label=mode,
        )
    ax.axhline(2.0, color="#c53030", linestyle="--", label="p99 target")
    ax.set_xticks(range(3), ["p50", "p99", "p99.9"])
    _save(
        fig,
        ax,
        "Latency at 50% of capacity (HDR histogram)",
        "ms, submit -> destination",
        RESULTS / "latency.png",
    )
    sc = load("scaling")
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for mode, curve in sc["records_per_s"].items():
        ax.plot([int(n) for n in curve], list(curve.values()), marker="o", label=mode)
    ax.set_xticks([1, 2, 4])
    ax.set_xlabel(f"workers / owners ({sc['cpu_count']} cores)")
    _save(
        fig,
        ax,
        "Scaling with a GIL-releasing numpy processor",
        "records/s",
        RESULTS / "scaling.png",
    )


def _save(fig: Any, ax: Any, title: str, ylabel: str, path: Path) -> None:
    import matplotlib.pyplot as plt

    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


#: What the profile says, for targets known to sit at the edge on 2 shared cores.
EXPLANATIONS = {
    "stateless_p99<=2ms": (
        "A stateless route hands each batch to a worker thread (`to_thread_run_sync`) and "
        "back, through the Trio scheduler (`unrolled_run`, `epoll`), while the producer "
        "thread competes for the same GIL on two cores; the median stays well under 1 ms "
        "but the tail sits around the 2 ms target from run to run (1.6 to 3.5 ms seen). "
        "Forward routes, with no thread hop, keep p99 under 1 ms."
    ),
    "forward_p99<=2ms": (
        "The forward route's tail is GIL hand-offs between the producer thread and the "
        "loop thread on two shared cores; see the profile."
    ),
}


def _fmt(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _targets(result: dict[str, Any]) -> list[tuple[str, bool]]:
    raw = result.get("targets") or result.get("targets_met") or {}
    return [(name, ok in (True, "met")) for name, ok in raw.items()]


def report(seconds: dict[str, float] | None) -> str:
    rt, fo, sb = load("route_throughput"), load("fanout_peers"), load("stateful_vs_bytewax")
    ch, lat, sc, ov = (
        load(n) for n in ("clickhouse_parity", "latency", "scaling", "overload_soak")
    )
    rows = [
        (
            "Forward route, 1 KiB records, 1024/batch",
            _fmt(rt["forward_records_per_s"]["median"]),
            "plain dict loop " + _fmt(rt["plain_loop_records_per_s"]["median"]),
            f"{rt['ratios']['forward_vs_plain_loop']:.1f}x",
            ">= 2 M/s and >= 3x",
        ),
        (
            "Fan-out to 3 routes",
            _fmt(rt["fanout3_records_per_s"]["median"]),
            "one route " + _fmt(rt["forward_records_per_s"]["median"]),
            f"{rt['ratios']['fanout3_vs_forward']:.2f}x",
            ">= 0.7x",
        ),
        (
            "Single-record submit (coalesced)",
            _fmt(rt["single_submit_records_per_s"]["median"]),
            "-",
            "-",
            ">= 250 k/s",
        ),
        (
            "Payload bytes allocated forwarding 1 GiB",
            f"{rt['allocation']['share']:.4%}",
            "-",
            "-",
            "< 1%",
        ),
        (
            "Fan-out x3 vs dict loop",
            _fmt(fo["taproute_records_per_s"]["median"]),
            "dict loop " + _fmt(fo["dict_loop_records_per_s"]["median"]),
            f"{fo['ratios']['taproute_vs_dict_loop']:.1f}x",
            ">= 3x",
        ),
        (
            "Fan-out x3 vs asyncio queues",
            _fmt(fo["taproute_records_per_s"]["median"]),
            "asyncio " + _fmt(fo["asyncio_queues_records_per_s"]["median"]),
            f"{fo['ratios']['taproute_vs_asyncio_queues']:.1f}x",
            ">= 3x",
        ),
        (
            "Forward GB/s vs memcpy of the bytes",
            f"{fo['taproute_effective_GBps']:.1f} GB/s",
            f"memcpy {fo['memcpy_GBps']['median']:.1f} GB/s",
            f"{fo['ratios']['taproute_GBps_vs_memcpy']:.2f}",
            "(reported)",
        ),
        (
            "Keyed running mean, 4096 keys x 64 floats",
            _fmt(sb["taproute_records_per_s"]["median"]),
            "Bytewax " + _fmt(sb["bytewax_records_per_s"]["median"]),
            f"{sb['ratios']['taproute_vs_bytewax']:.1f}x",
            ">= 10x",
        ),
        (
            "ClickHouse (chDB): routed vs direct sink",
            _fmt(ch["routed_rows_per_s"]["median"]),
            "direct " + _fmt(ch["direct_rows_per_s"]["median"]),
            f"{ch['ratios']['routed_vs_direct']:.2f}x",
            ">= 0.9x",
        ),
        (
            "ClickHouse (chDB): direct vs bare INSERT",
            _fmt(ch["direct_rows_per_s"]["median"]),
            "bare " + _fmt(ch["bare_rows_per_s"]["median"]),
            f"{ch['ratios']['direct_vs_bare']:.2f}x",
            ">= 0.8x",
        ),
    ]
    lines = [
        "# taproute bench report",
        "",
        f"Machine: {rt['cores']} cores, Python {rt['python']}. Every figure is the median of "
        "several runs, measured in the same process run as its peer on identical records; "
        "the JSON beside this file has the spread. Regenerate with `python -m bench`.",
        "",
        "![throughput](throughput.png)",
        "",
        "| what | taproute | peer | ratio | target |",
        "| --- | --- | --- | --- | --- |",
        *[f"| {a} | {b} | {c} | {d} | {e} |" for a, b, c, d, e in rows],
        "",
        "## Latency",
        "",
        "![latency](latency.png)",
        "",
        "| route | capacity rec/s | paced at | p50 | p99 | p99.9 | target |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode in ("forward", "stateless"):
        m = lat[mode]
        lines.append(
            f"| {mode} | {_fmt(m['capacity_records_per_s'])} | {_fmt(m['paced_records_per_s'])} "
            f"| {m['p50_us'] / 1000:.2f} ms | {m['p99_us'] / 1000:.2f} ms "
            f"| {m['p99_9_us'] / 1000:.2f} ms | p99 <= 2 ms |"
        )
    lines += [
        "",
        f"{lat['note']}. The stateless route's p99 sits near its target and varies from "
        "run to run on this shared 2-core machine (1.4 to 3.5 ms seen): each batch takes a "
        "worker-thread hop and back through the Trio scheduler, competing with the producer "
        "for the GIL. Forward routes have no hop.",
        "",
        "## Scaling",
        "",
        "![scaling](scaling.png)",
        "",
        "| workers / owners | " + " | ".join(sc["records_per_s"]["stateless"]) + " |",
        "| --- | --- | --- | --- |",
    ]
    for mode, curve in sc["records_per_s"].items():
        lines.append(f"| {mode} | " + " | ".join(_fmt(v) for v in curve.values()) + " |")
    lines += [
        "",
        f"On {sc['cpu_count']} cores the stateless curve rises from 1 to 2 workers "
        f"({sc['speedup_vs_1']['stateless']['2']:.2f}x) and flattens at 4 "
        f"({sc['speedup_vs_1']['stateless']['4']:.2f}x): two cores, and the record worker "
        "and producer need one between them. Stateful owners scale less "
        f"({sc['speedup_vs_1']['stateful']['2']:.2f}x at 2): each owner also updates its "
        "state slice after the numpy work.",
        "",
        "## Overload soak",
        "",
        f"A producer offering {_fmt(ov['offered_records_per_s'])} records/s (10x) to a "
        f"destination that takes {_fmt(ov['destination_capacity_records_per_s'])}/s, for "
        f"{ov['duration_s']:g} s: {_fmt(ov['submitted'])} submitted, "
        f"{_fmt(ov['delivered'])} delivered (in = out: "
        f"{'yes' if ov['submitted'] == ov['delivered'] else 'NO'}); the producer was blocked "
        f"{ov['producer_blocked_share']:.0%} of the time; RSS grew "
        f"{ov['rss_peak_growth_MiB']:.1f} MiB against configured capacities of "
        f"{ov['configured_capacity_bytes'] / 2**20:.0f} MiB (+10% bound "
        f"{ov['rss_bound_MiB']:.1f} MiB).",
        "",
        "## Targets",
        "",
    ]
    missed = []
    for name, result in (
        ("route_throughput", rt),
        ("fanout_peers", fo),
        ("stateful_vs_bytewax", sb),
        ("clickhouse_parity", ch),
        ("latency", lat),
        ("scaling", sc),
        ("overload_soak", ov),
    ):
        for target, ok in _targets(result):
            lines.append(f"- {name}: `{target}` — {'met' if ok else '**MISSED**'}")
            if not ok:
                missed.append((name, target, result))
    if missed:
        lines += ["", "## What dominates where a target is missed", ""]
        for name, target, result in missed:
            profile = result.get("profile") or [
                line for key, value in result.items() if key.endswith("profile") for line in value
            ]
            lines.append(f"### {name}: `{target}`")
            lines.append("")
            if target in EXPLANATIONS:
                lines += [EXPLANATIONS[target], ""]
            lines += ["```", *(profile or ["(no profile recorded)"]), "```", ""]
    if seconds:
        lines += [
            "",
            f"Suite wall time: {sum(seconds.values()):.0f} s "
            f"({', '.join(f'{k} {v:.0f} s' for k, v in seconds.items())}).",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    parser.add_argument("--report-only", action="store_true", help="rebuild the report")
    args = parser.parse_args()
    seconds = None if args.report_only else run_scripts(args.quick)
    charts()
    (RESULTS / "report.md").write_text(report(seconds))
    print(f"wrote {RESULTS / 'report.md'}")


if __name__ == "__main__":
    main()
