"""A child process for tests/test_chdb_directory_removed.py: a service built
from a config file routes into chDB, and its chDB directory is removed while
it runs (chDB allows one directory per process, hence a process of its own).

    python -m tests.chdb_removed_child run CONFIG
    python -m tests.chdb_removed_child recover CONFIG
    python -m tests.chdb_removed_child retrying CONFIG

``run`` submits records 0..63, flushes, removes the chDB directory, submits
64..127 and flushes again, then prints what the service reports as JSON.
``recover`` starts the service again from the same file, waits until
everything is delivered and prints what the table holds.  ``retrying``
removes the directory under a destination without a spool and reports its
failed insert attempts while the sink still retries.
"""

from __future__ import annotations

import json
import shutil
import sys
import threading
import time

import numpy as np

from taproute.service import load_config, make_descriptors


def submit(runtime, hook: int, first: int) -> None:
    seqs = np.arange(first, first + 64)
    descriptors = make_descriptors(
        hook, 16, count=64, keys=seqs, seqs=seqs, layout_ids=runtime.schema.layout_id("vec")
    )
    runtime.submit_batch(descriptors, np.ones((64, 4), np.float32))


def main(action: str, path: str) -> None:
    config = load_config(path)
    data = config.destinations["ch"].path_under(config.source.parent)
    assert data is not None
    report: dict[str, object] = {}
    with config.build() as built:
        runtime = built.start()
        if action == "run":
            hook = runtime.bind_hook("layers.0", layout="vec")
            submit(runtime, hook, 0)
            runtime.flush()
            shutil.rmtree(data)
            submit(runtime, hook, 64)
            try:
                flushed = runtime.flush()
                report["spooled_bytes"] = flushed.spooled_bytes.get("ch") if flushed else None
            except Exception as exc:
                report["flush_raised"] = f"{type(exc).__name__}: {exc}"
            snapshot = runtime.counters()
            destination = snapshot.destinations["ch"]
            report["healthy"] = destination.healthy
            report["reason"] = destination.unhealthy_reason
            report["failure"] = snapshot.failure
        elif action == "retrying":  # no spool: the sink retries on its own
            hook = runtime.bind_hook("layers.0", layout="vec")
            submit(runtime, hook, 0)
            runtime.flush()
            shutil.rmtree(data)
            submit(runtime, hook, 64)
            give_up = time.monotonic() + 60
            while (runtime.counters().destinations["ch"].insert_errors or 0) < 3:
                assert time.monotonic() < give_up, runtime.counters().destinations["ch"]
                threading.Event().wait(0.01)
            snapshot = runtime.counters()
            report["insert_errors_while_retrying"] = snapshot.destinations["ch"].insert_errors
            report["failure"] = snapshot.failure
        else:
            runtime.flush(wait=True)
        try:
            runtime.close()
        except Exception as exc:
            report["close_raised"] = f"{type(exc).__name__}: {exc}"
    if action == "recover":
        from taproute.service.sinks.clickhouse import ChdbTransport

        transport = ChdbTransport(data)
        row = transport.query(
            "SELECT count() AS n, uniqExact(seq) AS distinct, min(seq) AS low, "
            "max(seq) AS high FROM raw_vec"
        ).to_pylist()[0]
        transport.close()
        report.update(row)
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
