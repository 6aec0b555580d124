"""The bench harness's promises: interleaved rounds, summaries that keep raw
samples, result files that carry their metadata and are never overwritten."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import harness  # noqa: E402


def test_interleave_runs_variants_round_robin_after_warmup():
    calls: list[str] = []

    def variant(name: str, value: float):
        def run() -> float:
            calls.append(name)
            return value

        return run

    got = harness.interleave(
        {"a": variant("a", 1.0), "b": variant("b", 3.0)}, repeat=3, warmup=1, shuffle=False
    )
    assert calls == ["a", "b"] * 4  # never a block of one variant
    assert got["a"]["samples"] == [1.0, 1.0, 1.0] and got["b"]["median"] == 3.0


def test_summary_and_paired_ratio():
    s = harness.summary([4.0, 1.0, 2.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (2.0, 1.0, 4.0, 3)
    assert s["spread"] == pytest.approx(1.5)
    assert s["samples"] == [4.0, 1.0, 2.0]
    r = harness.ratio(harness.summary([2.0, 4.0]), harness.summary([1.0, 1.0]))
    assert (r["median"], r["paired_min"], r["paired_max"]) == (3.0, 2.0, 4.0)


def test_write_result_keeps_metadata_and_never_overwrites(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(harness, "RESULTS", tmp_path)
    first = harness.write_result("demo", params={"n": 3}, quick=True, notes=["x"])
    second = harness.write_result("demo", params={"n": 4}, quick=True)
    assert first != second and first.parent == second.parent
    assert first.name == "demo.quick.json" and second.name == "demo.quick.2.json"
    record = json.loads(first.read_text())
    meta = record["meta"]
    for key in ("commit", "dirty", "cpu_model", "cores", "load_average_start", "versions"):
        assert key in meta, key
    assert meta["params"] == {"n": 3} and "numpy" in meta["versions"]
    assert record["notes"] == ["x"]
    assert first.parent.name.startswith(meta["commit"])
    printed = capsys.readouterr().out.strip().splitlines()
    assert json.loads(printed[0])["bench"] == "demo"


def test_comparison_says_who_wins():
    fast, slow = harness.summary([2.0, 2.0]), harness.summary([1.0, 1.0])
    assert harness.comparison("x", fast, slow, taproute_label="t", peer_label="p", unit="r/s")[
        "taproute_wins"
    ]
    assert not harness.comparison(
        "x", fast, slow, taproute_label="t", peer_label="p", unit="ms", higher_is_better=False
    )["taproute_wins"]


def test_report_is_rendered_from_result_files_and_says_when_a_peer_wins(
    tmp_path, monkeypatch, capsys
):
    import run_all

    monkeypatch.setattr(harness, "RESULTS", tmp_path)
    slow, fast = harness.summary([1.0, 1.2, 0.9]), harness.summary([3.0, 3.3, 2.9])
    folder = harness.write_result(
        "plugged_in",
        params={},
        quick=False,
        comparisons=[
            harness.comparison(
                "x", slow, fast, taproute_label="t", peer_label="numpy", unit="records/s"
            )
        ],
        curves=[
            {
                "title": "c",
                "x_label": "n",
                "y_label": "r/s",
                "x": [1, 2],
                "series": {"taproute": [1.0, 2.0]},
            }
        ],
        targets=[harness.target("t >= peer", False, "0.33x")],
    ).parent
    results = run_all.latest_results(folder, quick=False)
    assert list(results) == ["plugged_in"]
    text = run_all.render(results, folder, None)
    assert "**peer**" in text and "**MISSED**" in text and "0.333x" in text
    assert "taproute is better on the median in 0 of 1" in text
    assert (folder / "plugged_in-0.png").exists()


def test_discover_picks_up_any_script_that_imports_the_harness(tmp_path, monkeypatch):
    import run_all

    (tmp_path / "mine.py").write_text("from harness import write_result\n")
    (tmp_path / "helper.py").write_text("import numpy\n")
    (tmp_path / "_shared.py").write_text("from harness import fmt\n")
    (tmp_path / "server.py").write_text("import harness\n# bench: not a script\n")
    (tmp_path / "route_throughput.py").write_text("import harness\n")
    monkeypatch.setattr(run_all, "HERE", tmp_path)
    assert run_all.discover() == ["route_throughput", "mine"]


def test_tables_with_dict_rows_render():
    import run_all

    columns, rows = run_all._table_parts({"title": "t", "rows": [{"a": 1, "b": 2}, {"a": 3}]})
    assert columns == ["a", "b"] and rows == [[1, 2], [3, None]]


def test_max_repeat_caps_the_default_repetitions_only(monkeypatch):
    monkeypatch.setenv(harness.MAX_REPEAT_ENV, "2")
    monkeypatch.setattr(sys, "argv", ["script"])
    assert harness.arguments(None, repeat=(9, 3)).repeat == 2
    assert harness.arguments(None, repeat=(1, 1)).repeat == 1  # never raised
    assert harness.metadata({})["max_repeat"] == 2
    monkeypatch.setattr(sys, "argv", ["script", "--repeat", "7"])
    assert harness.arguments(None, repeat=(9, 3)).repeat == 7  # asked for: kept
    monkeypatch.delenv(harness.MAX_REPEAT_ENV)
    monkeypatch.setattr(sys, "argv", ["script"])
    assert harness.arguments(None, repeat=(9, 3)).repeat == 9


def test_min_repeat_holds_a_full_run_above_the_cap_and_an_explicit_repeat(monkeypatch):
    """A script whose target is a median keeps its floor of rounds in a full
    run under any cap or --repeat; --quick is not held to it."""
    monkeypatch.setenv(harness.MAX_REPEAT_ENV, "2")
    monkeypatch.setattr(sys, "argv", ["script"])
    assert harness.arguments(None, min_repeat=5, repeat=(9, 3)).repeat == 5
    monkeypatch.setattr(sys, "argv", ["script", "--repeat", "3"])
    assert harness.arguments(None, min_repeat=5, repeat=(9, 3)).repeat == 5
    monkeypatch.setattr(sys, "argv", ["script", "--repeat", "7"])
    assert harness.arguments(None, min_repeat=5, repeat=(9, 3)).repeat == 7
    monkeypatch.setattr(sys, "argv", ["script", "--quick"])
    assert harness.arguments(None, min_repeat=5, repeat=(9, 3)).repeat == 2


def test_timed_rate_repeats_a_short_call_until_min_seconds_have_passed(monkeypatch):
    """A sample of a short call is the rate over back-to-back calls filling
    ``min_seconds``; without it, one call."""
    from types import SimpleNamespace

    now = [0.0]

    def clock() -> float:
        now[0] += 0.0625  # every reading is 1/16 s after the last (exact in binary)
        return now[0]

    fake = SimpleNamespace(perf_counter=clock, process_time=lambda: 0.0)
    monkeypatch.setattr(harness, "time", fake)
    calls: list[int] = []
    rate = harness.timed_rate(100, lambda: calls.append(1), min_seconds=0.25)
    assert len(calls) == 4  # elapsed 1/16, 2/16, 3/16, 4/16 s after each call
    assert rate == pytest.approx(100 * 4 / 0.25)
    calls.clear()
    assert harness.timed_rate(100, lambda: calls.append(1)) == pytest.approx(100 / 0.0625)
    assert len(calls) == 1
