"""Two replays of one run at once: the second is refused, naming the run and
the process that has it, and the first finishes untouched.  A driver killed
with its `processes` workers running: the workers exit, and the run resumes.

Both are real processes on a Parquet corpus (no chDB, whose one process per
directory would refuse the second before the replay is reached)."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
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

corpus, out, runs, resume, hold, backend = sys.argv[1:7]
done = []


def backend_settings(backend):
    if backend == "inprocess":
        return {}
    # running_sum merged across workers: its final rows only.
    return {"backend": backend, "workers": 2, "stateful_output": "final"}


def on_unit(unit):
    done.append(unit)
    print(unit, flush=True)
    if len(done) == int(hold):
        sys.stdin.readline()  # hold here, the run's lock held, until told to go on


settings = dict(
    source=ParquetCorpus([corpus], "vec"), processor="replay.running_sum", schema=SCHEMA,
    outputs={"sum": ParquetDir(out)}, runs_dir=Path(runs), checkpoint_units=1,
    stateful_output="units", progress=False, on_unit=on_unit,
    modules=("tests.replay_processors",),
)
settings.update(backend_settings(backend))
try:
    report = run_replay(**settings, resume=None if resume == "-" else resume)
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


def replay(
    tmp_path: Path, resume: str = "-", hold: int = 0, backend: str = "inprocess"
) -> subprocess.Popen:
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
            backend,
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


def worker_pids(parent: int) -> list[int]:
    """The replay worker processes ``parent`` spawned (multiprocessing's spawn)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue  # gone meanwhile
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and b"spawn_main" in cmdline:
            found.append(int(entry.name))
    return found


def running(pid: int) -> bool:
    """Whether ``pid`` runs (an exited orphan may linger as a zombie until reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_workers_of_a_killed_driver_exit(tmp_path):
    """SIGKILL the driver of a `processes` run: its workers, blocked waiting
    for the next unit, notice the driver is gone and exit.  (They waited on
    their inbox forever, orphaned to init, each holding a whole processor.)"""
    write_corpus(tmp_path / "corpus.parquet")
    driver = replay(tmp_path, hold=2, backend="processes")
    assert driver.stdout.readline().startswith("u")
    assert driver.stdout.readline().startswith("u")  # holding, its workers started
    workers = worker_pids(driver.pid)
    assert len(workers) == 2
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait(timeout=60)
    driver.stdin.close()
    deadline = time.monotonic() + 60
    for pid in workers:  # each pidfd turns readable when its process has exited
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue  # already gone
        try:
            select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        finally:
            os.close(fd)
    alive = [p for p in workers if running(p)]
    assert alive == [], f"replay workers {alive} outlived their driver"
    # The run resumes (the two units written are redone into the same part files).
    (run_dir,) = (tmp_path / "runs").iterdir()
    again = replay(tmp_path, resume=run_dir.name, backend="processes")
    out, err = again.communicate(timeout=120)
    assert again.returncode == 0, err
    assert json.loads(out.splitlines()[-1])["run_id"] == run_dir.name
    assert pq.read_table(tmp_path / "out").num_rows == 16  # final: one row per slot
