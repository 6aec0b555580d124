"""Replay throughput: a stateless processor over a stored corpus, against the
loop a user would write by hand, and the processes / Ray backends at 1 and 2
workers against in-process, in one run.

- corpus: ``raw_act`` on chDB (a temporary directory), 1 KiB float32 payloads,
  4 hooks, 8 records per key;
- taproute: ``run_replay`` of ``bench.act_norm`` (in-process; processes and
  Ray with 1 and 2 workers), output to a ClickHouse table; the clock stops
  when it returns (rows inserted, ledger written);
- hand-written: for the same (hook, key range) batches, ``SELECT`` as Arrow
  from chDB, flatten the list column to numpy, call the same ``norm_rows``,
  ``INSERT ... SELECT FROM Python(arrow)``: the framework's floor.

Rates are records/s and payload bytes/s.  Targets (issue #14): in-process
>= 0.9x the hand-written loop; near-linear scaling with workers (here: 2
cores shared with the driver, which reads and writes every unit).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
from _replay_processors import FLOATS, SCHEMA, norm_rows
from harness import arguments, comparison, fmt, interleave, target, write_result

from taproute.native import make_descriptors
from taproute.service import create_record_runtime, run_replay
from taproute.service.replay import ClickHouseCorpus, ClickHouseTable
from taproute.service.sinks.clickhouse import ChdbTransport, ClickHouseSink

HOOKS = 4
PER_KEY = 8


def make_corpus(transport: ChdbTransport, records: int) -> None:
    sink = ClickHouseSink(transport, SCHEMA, raw=["act"], create_tables=True, owns_transport=False)
    rng = np.random.default_rng(0)
    per_batch = 4096
    with create_record_runtime(record_sink=sink) as runtime:
        hooks = [runtime.bind_hook(f"layers.{h}.mlp", layout="act") for h in range(HOOKS)]
        for start in range(0, records, per_batch):
            n = min(per_batch, records - start)
            index = np.arange(start, start + n)
            values = rng.standard_normal((n, FLOATS), dtype=np.float32)
            desc = make_descriptors(
                np.asarray(hooks)[index % HOOKS],
                FLOATS * 4,
                count=n,
                layout_ids=0,
                keys=index // (HOOKS * PER_KEY),
                steps=(index // HOOKS) % PER_KEY,
                seqs=index,
            )
            runtime.submit_batch(desc, values)
        runtime.flush(timeout=300)


def hand_loop(transport: ChdbTransport, units: list, table: str) -> None:
    """What a user writes without taproute: batched reads, one numpy call, batched inserts."""
    for unit in units:
        data = transport.query(
            f"SELECT key, seq, values FROM raw_act WHERE hook = '{unit.hook}' "
            f"AND key >= {unit.key_first} AND key <= {unit.key_last} ORDER BY key, step, seq"
        )
        values = data.column("values").combine_chunks().flatten().to_numpy()
        rows = norm_rows(
            data.column("key").to_numpy(),
            data.column("seq").to_numpy(),
            values.reshape(data.num_rows, FLOATS),
        )
        arrow_input = pa.table({name: rows[name] for name in rows.dtype.names})  # noqa: F841
        transport.execute(
            f"INSERT INTO {table} (key, seq, norm) SELECT key, seq, norm FROM Python(arrow_input)"
        )


def main() -> None:
    args = arguments(__doc__, records=(262_144, 32_768), unit_rows=(16_384, 4096), repeat=(5, 2))
    directory = Path(tempfile.mkdtemp(prefix="taproute-replay-bench-"))
    try:
        run(args, directory)
    finally:
        # The corpus and every variant's output (hundreds of MB at full size) go with the run.
        shutil.rmtree(directory, ignore_errors=True)


def run(args: argparse.Namespace, directory: Path) -> None:
    transport = ChdbTransport(directory / "chdb")
    make_corpus(transport, args.records)
    corpus = ClickHouseCorpus(transport, "act")
    common = dict(
        source=corpus,
        processor="bench.act_norm",
        schema=SCHEMA,
        modules=("_replay_processors",),
        unit_rows=args.unit_rows,
        runs_dir=directory / "runs",
        progress=False,
    )
    plan = run_replay(**common, dry_run=True).plan
    # Measured: the ledger is written at start and end (one checkpoint per run),
    # which the output tables' deduplication window covers (every unit a resume
    # may redo; replay refuses a larger figure: NotExactlyOnce).
    common["checkpoint_units"] = len(plan)
    bench_dir = str(Path(__file__).resolve().parent)
    have_ray = True
    try:
        import ray

        ray.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": bench_dir}},
        )
    except ImportError:
        have_ray = False
    os.environ["PYTHONPATH"] = bench_dir + os.pathsep + os.environ.get("PYTHONPATH", "")

    def fresh(table: str) -> str:
        transport.execute(f"DROP TABLE IF EXISTS {table}")
        return table

    transport.execute(
        "CREATE TABLE hand_out (key Int64, seq Int64, norm Float32) ENGINE = MergeTree "
        "ORDER BY tuple()"
    )

    def hand() -> float:
        transport.execute("TRUNCATE TABLE hand_out")
        started = time.perf_counter()
        hand_loop(transport, plan, "hand_out")
        return args.records / (time.perf_counter() - started)

    def replayed(backend: str, workers: int):
        def run() -> float:
            table = fresh(f"out_{backend}_{workers}")
            started = time.perf_counter()
            run_replay(
                **common,
                outputs={"act_norm": ClickHouseTable(table)},
                backend=backend,
                workers=workers,
                schedule="pull",
            )
            return args.records / (time.perf_counter() - started)

        return run

    variants = {"hand-written": hand, "inprocess": replayed("inprocess", 1)}
    for workers in (1, 2):
        variants[f"processes x{workers}"] = replayed("processes", workers)
        if have_ray:
            variants[f"ray x{workers}"] = replayed("ray", workers)
    results = interleave(variants, repeat=args.repeat, warmup=1)
    counts = {
        name: transport.query(f"SELECT count() AS n FROM {t}").column("n")[0].as_py()
        for name, t in (("hand-written", "hand_out"), ("inprocess", "out_inprocess_1"))
    }
    assert counts == {"hand-written": args.records, "inprocess": args.records}, counts
    if have_ray:
        ray.shutdown()
    payload = FLOATS * 4
    inproc = comparison(
        "replay in-process vs the hand-written chDB/pyarrow loop",
        results["inprocess"],
        results["hand-written"],
        taproute_label="run_replay (inprocess)",
        peer_label="hand-written loop",
        unit="records/s",
    )
    rows = []
    for name, s in results.items():
        rows.append(
            {
                "variant": name,
                "records/s": round(s["median"]),
                "MB/s": round(s["median"] * payload / 1e6, 1),
                "spread": round(s["spread"], 3),
                "vs in-process": round(s["median"] / results["inprocess"]["median"], 3),
            }
        )
    targets = [
        target(
            "in-process >= 0.9x hand-written",
            inproc["ratio"]["median"] >= 0.9,
            f"{inproc['ratio']['median']:.3f}x",
        )
    ]
    notes = [
        f"in-process replay ran at {fmt(results['inprocess']['median'])} records/s, "
        f"{inproc['ratio']['median']:.2f}x the hand-written loop "
        f"({fmt(results['hand-written']['median'])} records/s).",
    ]
    for kind in ("processes", "ray"):
        if f"{kind} x1" in results:
            one, two = results[f"{kind} x1"]["median"], results[f"{kind} x2"]["median"]
            notes.append(
                f"{kind}: 2 workers {two / one:.2f}x 1 worker on {os.cpu_count()} cores "
                "(the driver reads and writes every unit on the same cores; each run "
                "includes starting its workers)."
            )
    write_result(
        "replay",
        params={
            "records": args.records,
            "unit_rows": args.unit_rows,
            "units": len(plan),
            "payload_bytes": payload,
            "repeat": args.repeat,
            "ray": importlib.metadata.version("ray") if have_ray else None,
            "python": sys.version.split()[0],
        },
        quick=args.quick,
        comparisons=[inproc],
        tables=[{"title": "replay backends (median records/s)", "rows": rows}],
        targets=targets,
        notes=notes,
        raw={"results": results},
        title="Replay throughput",
        description=__doc__.split("\n\n")[0],
    )
    transport.close()


if __name__ == "__main__":
    main()
