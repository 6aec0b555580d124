"""A child process for tests/test_park_crash.py: a service built from a config
file (chDB destination, dead-letter store beside it) routes 1,728 records
through a stateless route whose processor fails every 9th block of 16 records
(retryable), and is SIGKILLed at a chosen point.

    python -m tests.park_crash_child produce DIR KILL_AT
    python -m tests.park_crash_child recover DIR MODE

``produce`` submits every record, calls ``flush()`` and prints ``ack 1727``
(every record acknowledged), then: ``flushed`` kills itself at once (records
parked for a retry); ``mid_retry`` lets the retries start and is killed inside
the first one; ``retried`` heals the store, waits until every parked record
was retried to success, and kills itself at once, before they were forgotten
in the park store (their output may or may not be in ClickHouse yet).
``recover`` starts the same service (processor ``MODE``:
``ok`` or ``invalid``), waits for full delivery (``flush(wait=True)``), stops it
and prints one JSON line: the rows in ClickHouse (count, distinct seqs),
the dead letters (count, distinct seqs) and the flush report.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from taproute.service import make_descriptors
from taproute.service.ops.dead_letters import DeadLetterStore
from taproute.service.ops.parking import ParkedRecordStore
from taproute.service.sinks.clickhouse import ChdbTransport
from tests.park_child_setup import config, die, start
from tests.processors import SCHEMA

BATCHES, BATCH = 108, 16  # 1,728 records; 12 batches (192 records) fail while broken

CONFIG = config(
    "tests.park_processors",
    """
[[routes]]
name = "norms"
outputs = ["q"]
mode = "stateless"
processor = "park.flaky"
destination = "ch"
workers = 2

[routes.failure_policy]
deadline = 0.0
initial_backoff = 0.05
max_backoff = 0.05
max_failures = 1000
failure_window = 3600.0
""",
)


def submit_batches(runtime: Any) -> None:
    """Submit the test's BATCHES batches of BATCH records of hook ``q``
    (record ``i`` holds ``i, i+1, i+2, i+3``; keys 0..BATCH-1 in each batch)."""
    q = runtime.bind_hook("q", layout="vec")
    vec = SCHEMA.layout_id("vec")
    for b in range(BATCHES):
        first = b * BATCH
        values = (np.arange(first, first + BATCH, dtype=np.float32)[:, None] + np.arange(4)).astype(
            np.float32
        )
        runtime.submit_batch(
            make_descriptors(
                q,
                16,
                count=BATCH,
                layout_ids=vec,
                keys=np.arange(BATCH),
                seqs=np.arange(first, first + BATCH),
            ),
            values,
        )


def produce(directory: Path, kill_at: str) -> None:
    os.environ["TAPROUTE_PARK_MODE"] = "kill_on_retry" if kill_at == "mid_retry" else "fail"
    _, runtime = start(directory, CONFIG)
    submit_batches(runtime)
    report = runtime.flush()
    print(f"ack {BATCHES * BATCH - 1}", flush=True)
    print(f"report {json.dumps(_report(report))}", flush=True)
    if kill_at == "flushed":
        die()
    from tests.park_processors import HEALED, KILL_ARMED

    if kill_at == "retried":
        HEALED.set()
        deadline = time.monotonic() + 60
        while runtime.counters().routes["norms"].processed < BATCHES * BATCH:
            if time.monotonic() > deadline:
                sys.exit(4)
            time.sleep(0.01)  # the child's own wait, not a test's synchronisation
        print("retried", flush=True)
        die()
    KILL_ARMED.set()
    deadline = time.monotonic() + 60  # mid_retry: the processor kills us at its first retry
    while time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit(3)


def _report(report: object) -> object:
    if report is None:  # a flush that reports nothing (before flush reports existed)
        return None
    import attrs

    return attrs.asdict(report)  # type: ignore[arg-type]


def recover(directory: Path, mode: str) -> None:
    os.environ["TAPROUTE_PARK_MODE"] = mode
    built, runtime = start(directory, CONFIG)
    with built:
        report = runtime.flush(wait=True)
        runtime.stop()
    ch = ChdbTransport(directory / "chdb")
    row_seqs = [int(s) for s in ch.query("SELECT seq FROM norm").column("seq").to_pylist()]
    store = DeadLetterStore(directory / "chdb-dead-letters.sqlite", create=False)
    letter_seqs = [letter.seq for letter in store.list(state="dead", limit=10**6)]
    print(
        json.dumps(
            {
                "rows": len(row_seqs),
                "distinct_rows": len(set(row_seqs)),
                "letters": len(letter_seqs),
                "distinct_letters": len(set(letter_seqs)),
                "in_both": len(set(row_seqs) & set(letter_seqs)),
                "twice": sorted(
                    {s for s in row_seqs if row_seqs.count(s) > 1}
                    | (set(row_seqs) & set(letter_seqs))
                ),
                "covered": len(set(row_seqs) | set(letter_seqs)),
                "parked_left": ParkedRecordStore(store).count(),
                "report": _report(report),
            }
        ),
        flush=True,
    )


def main() -> None:
    command, directory, arg = sys.argv[1:4]
    if command == "produce":
        produce(Path(directory), arg)
    else:
        recover(Path(directory), arg)


if __name__ == "__main__":
    main()
