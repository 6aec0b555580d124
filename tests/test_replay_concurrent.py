"""Two replays of one run at once: the second is refused, naming the run and
the process that has it, and the first finishes untouched.

Both are real processes on a Parquet corpus (no chDB, whose one process per
directory would refuse the second before the replay is reached)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = r"""
import json, sys
from pathlib import Path
from taproute.service import run_replay
from taproute.service.replay import ParquetCorpus, ParquetDir, ReplayConfigError
import tests.replay_processors  # registers replay.running_sum
from tests.processors import SCHEMA

corpus, out, runs, resume, hold = sys.argv[1:6]
done = []


def on_unit(unit):
    done.append(unit)
    print(unit, flush=True)
    if len(done) == int(hold):
        sys.stdin.readline()  # hold here, the run's lock held, until told to go on


try:
    report = run_replay(
        source=ParquetCorpus([corpus], "vec"), processor="replay.running_sum", schema=SCHEMA,
        outputs={"sum": ParquetDir(out)}, runs_dir=Path(runs), checkpoint_units=1,
        stateful_output="units", progress=False, on_unit=on_unit,
        resume=None if resume == "-" else resume,
    )
except ReplayConfigError as exc:
    print(json.dumps({"refused": type(exc).__name__, "message": str(exc)}), flush=True)
    sys.exit(2)
print(json.dumps({"run_id": report.run_id, "run": report.units_run}), flush=True)
"""


def write_corpus(path: Path) -> None:
    """A raw `vec` table as Parquet: one hook, 64 keys x 2 steps, 16-row row groups."""
    keys = np.tile(np.arange(64), 2)
    n = len(keys)
    values = np.random.default_rng(5).integers(-9, 9, size=(n, 4)).astype(np.float32)
    table = pa.table(
        {
            "hook": pa.array(["layers.0.attn.q"] * n),
            "output_id": pa.array(np.full(n, 16), pa.uint32()),
            "key": pa.array(keys, pa.int64()),
            "step": pa.array(np.repeat([0, 1], 64), pa.int64()),
            "seq": pa.array(np.arange(n), pa.int64()),
            "timestamp": pa.array(np.arange(n) * 1000, pa.timestamp("ns", tz="UTC")),
            "values": pa.array(list(values), pa.list_(pa.float32())),
            "values_shape": pa.array([[4]] * n, pa.list_(pa.uint32())),
        }
    )
    pq.write_table(table, path, row_group_size=16)


def replay(tmp_path: Path, resume: str = "-", hold: int = 0) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            SCRIPT,
            str(tmp_path / "corpus.parquet"),
            str(tmp_path / "out"),
            str(tmp_path / "runs"),
            resume,
            str(hold),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def test_a_second_driver_of_a_running_run_is_refused(tmp_path):
    write_corpus(tmp_path / "corpus.parquet")
    first = replay(tmp_path, hold=2)
    assert first.stdout.readline().startswith("u")
    assert first.stdout.readline().startswith("u")  # holding: 2 units written, run locked
    (run_dir,) = (tmp_path / "runs").iterdir()
    second = replay(tmp_path, resume=run_dir.name)
    out, err = second.communicate(timeout=120)
    assert second.returncode == 2, err
    refused = json.loads(out.splitlines()[-1])
    assert refused["refused"] == "RunInUse"
    assert run_dir.name in refused["message"] and f"pid {first.pid}" in refused["message"]
    out, err = first.communicate("go\n", timeout=120)
    assert first.returncode == 0, err
    assert json.loads(out.splitlines()[-1]) == {"run_id": run_dir.name, "run": 8}
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert ledger["status"] == "finished" and len(ledger["units"]) == 8
    assert pq.read_table(tmp_path / "out").num_rows == 128
    # Once the first has ended, the run is free again: a resume finds nothing to do.
    again = replay(tmp_path, resume=run_dir.name)
    out, err = again.communicate(timeout=120)
    assert again.returncode == 0, err
    assert json.loads(out.splitlines()[-1]) == {"run_id": run_dir.name, "run": 0}
