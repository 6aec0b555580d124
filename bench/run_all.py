"""Run every bench script, each in a fresh process, then build ``report.md``
and its charts from the result files of this commit only.

    python -m bench [--quick] [--max-repeat N] [--only a,b] [--report-only] [--commit SHORT]

``--max-repeat N`` caps every script's repetitions at N (the comparisons
stay the same; each gets fewer interleaved rounds): the way to run the full
set in about 20 minutes (see bench/README.md).

Scripts are discovered (see bench/README.md): any ``bench/*.py`` that
imports ``harness``.  Nothing here is specific to one script: the report
renders each result file's comparisons, tables, curves, targets and notes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from harness import MAX_REPEAT_ENV, RESULTS, fmt, results_dir  # noqa: E402

#: Report order; scripts not listed follow alphabetically.
SCRIPTS = [
    "route_throughput",
    "fanout_peers",
    "stateful_vs_bytewax",
    "clickhouse_parity",
    "latency",
    "scaling",
    "overload_soak",
    "inference_cost",
    "hook_wakeup",
    "serve_load",
]
NOT_SCRIPTS = {"harness", "run_all", "__main__", "inference_server"}
MARKER = "# bench: not a script"
#: A script running longer than this is stopped and reported as failed.
TIMEOUT_S = 1800
QUICK_TIMEOUT_S = 300


def discover() -> list[str]:
    """Bench scripts in report order."""
    found = []
    for path in HERE.glob("*.py"):
        name = path.stem
        if name in NOT_SCRIPTS or name.startswith("_"):
            continue
        text = path.read_text()
        if MARKER in text or ("from harness import" not in text and "import harness" not in text):
            continue
        found.append(name)
    order = {name: i for i, name in enumerate(SCRIPTS)}
    return sorted(found, key=lambda n: (order.get(n, len(order)), n))


def run_scripts(
    names: list[str], quick: bool, max_repeat: int | None = None
) -> dict[str, dict[str, Any]]:
    """Run each script; returns ``{name: {"seconds", "rc"}}``.  A failing
    script is reported, and the others still run."""
    out: dict[str, dict[str, Any]] = {}
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    if max_repeat is not None:
        env[MAX_REPEAT_ENV] = str(max_repeat)
    for name in names:
        started = time.monotonic()
        print(f"== {name}", flush=True)
        try:
            proc = subprocess.run(
                [
                    sys.executable,
                    str(HERE / f"{name}.py"),
                    *(["--quick"] if quick else []),
                ],
                env=env,
                capture_output=True,
                text=True,
                timeout=QUICK_TIMEOUT_S if quick else TIMEOUT_S,
            )
            rc, stderr = proc.returncode, proc.stderr
        except subprocess.TimeoutExpired as exc:
            rc, stderr = -1, f"timed out after {exc.timeout} s\n{exc.stderr or ''}"
        seconds = time.monotonic() - started
        out[name] = {"seconds": seconds, "rc": rc}
        print(f"   {seconds:.0f} s, exit {rc}", flush=True)
        if rc:
            tail = stderr[-3000:] if isinstance(stderr, str) else repr(stderr)[-3000:]
            out[name]["stderr_tail"] = tail
            print(tail, file=sys.stderr)
    return out


# -- loading results -----------------------------------------------------------


def latest_results(folder: Path, quick: bool) -> dict[str, dict[str, Any]]:
    """The newest result file per script in ``folder`` (full or quick runs)."""
    best: dict[str, tuple[Any, dict[str, Any]]] = {}
    for path in folder.glob("*.json"):
        if path.name.startswith("suite."):
            continue
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if not isinstance(record, dict) or "bench" not in record:
            continue
        if bool(record.get("quick")) != quick:
            continue
        when = (record.get("meta", {}).get("when", ""), path.stat().st_mtime)
        name = record["bench"]
        if name not in best or when > best[name][0]:
            best[name] = (when, record)
    order = {name: i for i, name in enumerate(SCRIPTS)}
    return {
        name: best[name][1] for name in sorted(best, key=lambda n: (order.get(n, len(order)), n))
    }


# -- charts ----------------------------------------------------------------------


def chart(curve: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.4))
    xs = curve["x"]
    numeric = all(isinstance(x, int | float) for x in xs)
    positions = xs if numeric else list(range(len(xs)))
    for label, ys in curve["series"].items():
        points = [(x, y) for x, y in zip(positions, ys, strict=False) if y is not None]
        if not points:
            continue
        style = "-o" if "taproute" in label else "--s"
        ax.plot(
            [p[0] for p in points],
            [p[1] for p in points],
            style,
            label=label,
            markersize=4,
        )
    if curve.get("log_x") and numeric:
        ax.set_xscale("log", base=2)
    if curve.get("log_y"):
        ax.set_yscale("log")
    if not numeric:
        ax.set_xticks(positions, [str(x) for x in xs], rotation=20, fontsize=8)
    ax.set_xlabel(curve.get("x_label", ""))
    ax.set_ylabel(curve.get("y_label", ""))
    ax.set_title(curve["title"], fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def ratio_chart(comparisons: list[tuple[str, dict[str, Any]]], path: Path) -> None:
    """Every comparison's taproute/peer ratio (log scale; right of 1: taproute better
    when higher is better), with the paired range as an error bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, values, lows, highs, colors = [], [], [], [], []
    for name, c in comparisons:
        r = c["ratio"]
        flip = not c["higher_is_better"]
        value = 1 / r["median"] if flip else r["median"]
        lo, hi = (
            (1 / r["paired_max"], 1 / r["paired_min"])
            if flip
            else (r["paired_min"], r["paired_max"])
        )
        labels.append(
            f"{name}: {c['taproute']['label']} vs {c['peer']['label']}; {c['what']}"[:110]
        )
        values.append(value)
        lows.append(max(value - lo, 0))
        highs.append(max(hi - value, 0))
        colors.append("#2f855a" if c["taproute_wins"] else "#c53030")
    fig, ax = plt.subplots(figsize=(10, 0.28 * len(labels) + 1.2))
    ys = list(range(len(labels)))[::-1]
    # Bars start at 1 (parity) and reach the ratio, left for a loss, right for a win.
    ax.barh(
        ys, [v - 1 for v in values], left=1, color=colors, xerr=[lows, highs], error_kw={"lw": 0.7}
    )
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_xscale("log")
    ax.set_yticks(ys, labels, fontsize=6)
    ax.set_xlabel("taproute advantage (x, log): > 1 taproute better, < 1 the peer better")
    ax.set_title(
        "Every comparison in this report (bars: median, whiskers: paired range)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- report ----------------------------------------------------------------------


def _cell(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return fmt(value)
    if isinstance(value, int):
        return f"{value:,}"
    return str(value).replace("|", "\\|")


def _table(columns: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return lines


def _table_parts(table: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """A result's table as (columns, rows): ``columns`` + list rows, or rows
    given as dicts (columns taken from their keys, in order)."""
    rows = table.get("rows", [])
    columns = list(table.get("columns") or [])
    if rows and isinstance(rows[0], dict):
        for row in rows:
            columns += [key for key in row if key not in columns]
        return columns, [[row.get(c) for c in columns] for row in rows]
    return columns, [list(row) for row in rows]


def _comparison_rows(comparisons: list[dict[str, Any]]) -> list[list[Any]]:
    rows = []
    for c in comparisons:
        t, p, r = c["taproute"], c["peer"], c["ratio"]
        verdict = "taproute" if c["taproute_wins"] else "**peer**"
        rows.append(
            [
                c["what"],
                f"{t['label']}: {fmt(t['median'])} ({fmt(t['min'])} to {fmt(t['max'])})",
                f"{p['label']}: {fmt(p['median'])} ({fmt(p['min'])} to {fmt(p['max'])})",
                c["unit"] + (" (lower is better)" if not c["higher_is_better"] else ""),
                f"{r['median']:.3g}x ({r['paired_min']:.3g} to {r['paired_max']:.3g})",
                verdict,
            ]
        )
    return rows


COMPARISON_COLUMNS = [
    "what",
    "taproute median (min to max)",
    "peer median (min to max)",
    "unit",
    "ratio taproute/peer (paired range)",
    "better",
]


def render(results: dict[str, dict[str, Any]], folder: Path, suite: dict[str, Any] | None) -> str:
    lines = ["# taproute bench report", ""]
    if not results:
        return "\n".join([*lines, "No result files found.", ""])
    metas = [r["meta"] for r in results.values()]
    first = metas[0]
    commits = sorted({f"{m['commit']}{' (dirty)' if m['dirty'] else ''}" for m in metas})
    loads = [m["load_average_start"][0] for m in metas if m.get("load_average_start")]
    loads += [m["load_average_end"][0] for m in metas if m.get("load_average_end")]
    quick = any(r.get("quick") for r in results.values())
    caps = sorted({m["max_repeat"] for m in metas if m.get("max_repeat")})
    lines += [
        "Generated by `bench/run_all.py` from the result files in this folder; every "
        "figure below comes from them. "
        + ("**Quick run** (few repetitions, short runs: development only). " if quick else ""),
        "",
        f"- commit: {', '.join(commits)}",
        f"- machine: {first['cpu_model']}, {first['cores']} cores; {first['platform']}",
        f"- 1-minute load average seen during the runs: {min(loads):.2f} to {max(loads):.2f}"
        if loads
        else "- load average: not recorded",
        f"- versions: {', '.join(f'{k} {v}' for k, v in first['versions'].items())}",
        f"- runs: {', '.join(m['when'] for m in metas[:1])} to {metas[-1]['when']}",
        *(
            [f"- repetitions capped at {', '.join(map(str, caps))} (`--max-repeat`)"]
            if caps
            else []
        ),
        "",
        "Medians of interleaved repetitions; min to max in brackets; ratios are "
        "taproute / peer with the range of the per-round (paired) ratios. "
        "'better' names who wins on the median.",
        "",
    ]
    all_comparisons = [(name, c) for name, r in results.items() for c in r.get("comparisons", [])]
    if all_comparisons:
        try:
            ratio_chart(all_comparisons, folder / "ratios.png")
        except Exception as exc:  # a chart failing must not lose the report
            print(f"ratio chart failed: {exc}", file=sys.stderr)
        wins = sum(1 for _, c in all_comparisons if c["taproute_wins"])
        lines += [
            "## Summary: every comparison",
            "",
            f"taproute is better on the median in {wins} of {len(all_comparisons)} "
            "comparisons; where a peer wins, it says **peer**.",
            "",
            "![every comparison](ratios.png)",
            "",
            *_table(
                ["bench", *COMPARISON_COLUMNS],
                [[name, *row] for name, c in all_comparisons for row in _comparison_rows([c])],
            ),
            "",
        ]
    all_targets = [(name, t) for name, r in results.items() for t in r.get("targets", [])]
    if all_targets:
        lines += [
            "## Targets",
            "",
            *_table(
                ["bench", "target", "this run", "figures"],
                [
                    [n, t["name"], "met" if t["met"] else "**MISSED**", t["detail"]]
                    for n, t in all_targets
                ],
            ),
            "",
        ]
    for name, result in results.items():
        meta = result["meta"]
        # The script and the options that made it (inference_cost_pinned is
        # inference_cost.py --pin apart); older results name only the bench.
        script = meta.get("script") or f"{name}.py"
        options = [a for a in meta.get("argv", []) if name != script.removesuffix(".py")]
        command = " ".join([script, *options])
        lines += [f"## {result.get('title') or name} (`{command}`)", ""]
        if result.get("description"):
            lines += [result["description"], ""]
        lines += [
            f"Run {meta['when']}, {meta.get('duration_s')} s, load average "
            f"{meta.get('load_average_start')} → {meta.get('load_average_end')}; "
            f"parameters: `{json.dumps(meta.get('params', {}), sort_keys=True)}`",
            "",
        ]
        for note in result.get("notes", []):
            lines += [f"- {note}"]
        if result.get("notes"):
            lines.append("")
        if result.get("comparisons"):
            lines += [
                *_table(COMPARISON_COLUMNS, _comparison_rows(result["comparisons"])),
                "",
            ]
        for i, curve in enumerate(result.get("curves", [])):
            png = f"{name}-{i}.png"
            try:
                chart(curve, folder / png)
                lines += [f"![{curve['title']}]({png})", ""]
            except Exception as exc:  # a chart failing must not lose the report
                lines += [f"(chart failed: {exc})", ""]
            columns = [curve.get("x_label") or "x", *curve["series"]]
            rows = [
                [
                    x,
                    *[ys[j] if j < len(ys) else None for ys in curve["series"].values()],
                ]
                for j, x in enumerate(curve["x"])
            ]
            lines += [f"**{curve['title']}** ({curve.get('y_label', '')})", ""]
            lines += [*_table(columns, rows), ""]
        for table in result.get("tables", []):
            columns, rows = _table_parts(table)
            lines += [f"**{table.get('title', '')}**", "", *_table(columns, rows), ""]
        for t in result.get("targets", []):
            lines.append(
                f"- target `{t['name']}`: {'met' if t['met'] else '**MISSED**'} — {t['detail']}"
            )
        if result.get("targets"):
            lines.append("")
        profile = result.get("raw", {}).get("profile")
        if profile:
            lines += [
                "Profile (all threads, CPU time):",
                "",
                "```",
                *profile,
                "```",
                "",
            ]
    if suite:
        lines += [
            "## Suite",
            "",
            *_table(
                ["script", "seconds", "exit"],
                [[n, round(s["seconds"]), s["rc"]] for n, s in suite.items()],
            ),
            "",
        ]
        failed = [n for n, s in suite.items() if s["rc"]]
        if failed:
            lines += [
                f"Scripts that failed this run (no result above): {', '.join(failed)}",
                "",
            ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="short runs (a few minutes in all)")
    parser.add_argument("--report-only", action="store_true", help="rebuild the report only")
    parser.add_argument(
        "--max-repeat",
        type=int,
        help="cap every script's repetitions at N (same comparisons, fewer rounds)",
    )
    parser.add_argument("--only", help="comma-separated scripts to run")
    parser.add_argument("--commit", help="results folder to report on (default: this commit)")
    args = parser.parse_args()
    folder = RESULTS / args.commit if args.commit else results_dir()
    suite = None
    if not args.report_only:
        names = discover()
        if args.only:
            wanted = args.only.split(",")
            names = [n for n in names if n in wanted]
        if args.max_repeat is not None and args.max_repeat < 1:
            parser.error("--max-repeat must be at least 1")
        started = time.monotonic()
        suite = run_scripts(names, args.quick, args.max_repeat)
        print(f"suite: {time.monotonic() - started:.0f} s", flush=True)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / ("suite.quick.json" if args.quick else "suite.json")).write_text(
            json.dumps(suite, indent=1) + "\n"
        )
    elif (folder / ("suite.quick.json" if args.quick else "suite.json")).exists():
        suite = json.loads(
            (folder / ("suite.quick.json" if args.quick else "suite.json")).read_text()
        )
    results = latest_results(folder, args.quick)
    folder.mkdir(parents=True, exist_ok=True)
    name = "report.quick.md" if args.quick else "report.md"
    (folder / name).write_text(render(results, folder, suite))
    print(f"wrote {folder / name}")
    if not args.quick:
        # The latest full report, where the README links to it (charts stay
        # in the commit's folder).
        text = re.sub(r"\]\(([^)/]+\.png)\)", rf"]({folder.name}/\1)", (folder / name).read_text())
        (RESULTS / "report.md").write_text(text)
        print(f"wrote {RESULTS / 'report.md'}")
    if suite and any(s["rc"] for s in suite.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
