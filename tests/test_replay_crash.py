"""A replay killed with SIGKILL mid-run and resumed writes exactly what an
uninterrupted run writes: no unit lost, none written twice.

Each step runs in its own process (chDB opens one data directory per
process, and the killed driver must be a real process)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = r"""
import json, sys
from pathlib import Path
import numpy as np
from taproute.service.sinks.clickhouse import ChdbTransport, ClickHouseSink
from taproute.service import create_record_runtime, make_descriptors, run_replay
from taproute.service.replay import ClickHouseCorpus, ClickHouseTable, ParquetDir
import tests.replay_processors  # registers replay.running_sum
from tests.processors import SCHEMA

step, data, runs, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
transport = ChdbTransport(data)
if step == "capture":
    sink = ClickHouseSink(transport, SCHEMA, raw=["vec"], create_tables=True, owns_transport=False)
    rng = np.random.default_rng(3)
    with create_record_runtime(record_sink=sink) as runtime:
        for h in range(2):
            hook = runtime.bind_hook(f"layers.{h}.attn.q", layout="vec")
            for s in range(4):
                values = rng.integers(-9, 9, size=(64, 4)).astype(np.float32)
                runtime.submit_batch(
                    make_descriptors(hook, 16, count=64, layout_ids=0, keys=np.arange(64),
                                     steps=s, seqs=np.arange(64) + 64 * (4 * h + s)),
                    values,
                )
        runtime.flush(timeout=60)
    sys.exit(0)

processor, lane, mode, prefix, resume, block_after, hold_at = sys.argv[5:12]
done = []


def on_unit(unit):
    done.append(unit)
    print(unit, flush=True)
    if hold_at == "unit" and len(done) == int(block_after):
        sys.stdin.readline()  # hold here (units written, not yet ledgered) until killed


if hold_at == "checkpoint":
    import os

    rename, ledgers = os.replace, []

    def replace(source, target):
        # Hold just before checkpoint number `block_after` (the run's first is 0)
        # renames its ledger into place: its state is written, its ledger is not.
        if str(target).endswith("ledger.json"):
            if len(ledgers) == int(block_after):
                print("checkpoint", flush=True)
                sys.stdin.readline()
            ledgers.append(target)
        rename(source, target)

    os.replace = replace

target = (ParquetDir(str(out / prefix)) if mode == "parquet"
          else ClickHouseTable(f"{prefix}_{lane}"))
settings = dict(
    source=ClickHouseCorpus(transport, "vec"), processor=processor, schema=SCHEMA,
    outputs={lane: target}, runs_dir=runs / prefix, unit_rows=16, checkpoint_units=3,
    stateful_output="units", progress=False,
    on_unit=on_unit,
)
report = run_replay(**settings, resume=None if resume == "-" else resume)
print(json.dumps({"run_id": report.run_id, "run": report.units_run,
                  "skipped": report.units_skipped}), flush=True)
"""

QUERY = r"""
import json, sys
from taproute.service.sinks.clickhouse import ChdbTransport
t = ChdbTransport(sys.argv[1])
print(json.dumps({name: t.query(sql).to_pylist() for name, sql in json.loads(sys.argv[2]).items()}))
"""


def python(*args: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-c", *args],
        cwd=ROOT,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **kwargs,
    )


def finish(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("crash")
    finish(python(SCRIPT, "capture", str(root / "chdb"), str(root / "runs"), str(root / "out")))
    return root


def replay_step(
    root: Path,
    processor: str,
    lane: str,
    mode: str,
    prefix: str,
    resume="-",
    block_after=0,
    hold_at="unit",
):
    return python(
        SCRIPT,
        "run",
        str(root / "chdb"),
        str(root / "runs"),
        str(root / "out"),
        processor,
        lane,
        mode,
        prefix,
        resume,
        str(block_after),
        hold_at,
        stdin=subprocess.PIPE,
    )


def kill_after(proc: subprocess.Popen, units: int) -> None:
    """SIGKILL the driver once it reported ``units`` units written; it waits there
    (on its stdin), so the kill lands between a write and the next checkpoint."""
    for _ in range(units):
        line = proc.stdout.readline()
        assert line.startswith("u"), proc.stderr.read()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    proc.stdin.close()


@pytest.mark.parametrize(
    ("processor", "lane", "mode"),
    [
        ("test.norms", "norm", "clickhouse"),
        ("replay.running_sum", "sum", "clickhouse"),  # state restored from the checkpoint
        ("test.norms", "norm", "parquet"),
    ],
)
def test_sigkill_then_resume_equals_an_uninterrupted_run(data, processor, lane, mode):
    crashed, clean = f"crash_{lane}_{mode}", f"clean_{lane}_{mode}"
    finish(replay_step(data, processor, lane, mode, clean))
    proc = replay_step(data, processor, lane, mode, crashed, block_after=5)
    kill_after(proc, 5)  # units 1-3 checkpointed, 4-5 written but not in the ledger
    (run_dir,) = (data / "runs" / crashed).iterdir()
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert ledger["status"] == "running" and len(ledger["units"]) == 3  # last checkpoint
    out = finish(replay_step(data, processor, lane, mode, crashed, resume=run_dir.name))
    summary = json.loads(out.splitlines()[-1])
    assert summary["run_id"] == run_dir.name
    assert summary["skipped"] == 3 and summary["run"] == 32 - 3
    result = outputs(data, lane, mode, crashed, clean)
    assert len(result[clean]) == 512
    assert result[crashed] == result[clean]
    # Equal as sorted lists already rules out a unit written twice; say it plainly too.
    # (running_sum's rows repeat legitimately: keys k and k + 16 share a slot.)
    assert result[f"{crashed}_dupes"] == result[f"{clean}_dupes"]
    if lane == "norm":
        assert result[f"{crashed}_dupes"] == [{"n": 0}]


def outputs(data: Path, lane: str, mode: str, crashed: str, clean: str) -> dict:
    """Both runs' rows, sorted, and how many distinct rows each holds more than once."""
    order = "key, seq" if lane == "norm" else "key, count"
    if mode == "parquet":
        source = "file('{}/*.parquet', Parquet)"
        tables = {n: source.format(data / "out" / n) for n in (crashed, clean)}
    else:
        tables = {n: f"{n}_{lane}" for n in (crashed, clean)}
    queries = {n: f"SELECT * FROM {t} ORDER BY {order}" for n, t in tables.items()}
    for name in (crashed, clean):
        queries[f"{name}_dupes"] = (
            f"SELECT count() AS n FROM (SELECT * FROM {tables[name]} GROUP BY ALL "
            "HAVING count() > 1)"
        )
    return json.loads(finish(python(QUERY, str(data / "chdb"), json.dumps(queries))))


@pytest.mark.parametrize("mode", ["clickhouse", "parquet"])
def test_sigkill_inside_a_checkpoint_resumes_from_a_consistent_state(data, mode):
    """Killed after a checkpoint wrote the stateful state but before its ledger
    was renamed into place: the ledger on disk is the previous checkpoint's, so
    the state a resume starts from must be that checkpoint's too.  (The state
    file was replaced first, so the resume added units 4-6 into a state that
    already held them: every running sum after them came out wrong.)"""
    processor, lane = "replay.running_sum", "sum"
    crashed, clean = f"crash_in_checkpoint_{mode}", f"clean_in_checkpoint_{mode}"
    finish(replay_step(data, processor, lane, mode, clean))
    proc = replay_step(data, processor, lane, mode, crashed, block_after=2, hold_at="checkpoint")
    # on_unit reports a unit after the checkpoint that follows it: five units,
    # then the checkpoint after unit 6 (the run's third) holds.
    lines = [proc.stdout.readline() for _ in range(6)]
    assert [line[:1] for line in lines] == ["u"] * 5 + ["c"], lines
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    proc.stdin.close()
    (run_dir,) = (data / "runs" / crashed).iterdir()
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert ledger["status"] == "running" and len(ledger["units"]) == 3
    out = finish(replay_step(data, processor, lane, mode, crashed, resume=run_dir.name))
    assert json.loads(out.splitlines()[-1])["skipped"] == 3
    result = outputs(data, lane, mode, crashed, clean)
    assert len(result[clean]) == 512
    assert result[crashed] == result[clean]
