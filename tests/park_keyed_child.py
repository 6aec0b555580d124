"""A child process for tests/test_park_crash.py's keyed case: a stateful route
(``park.keyed_count``, 16 keys) whose key 3 fails, 1,024 records, SIGKILL after
``flush()`` returned with key 3's records parked (the failing one and those
waiting behind it).

    python -m tests.park_keyed_child produce DIR
    python -m tests.park_keyed_child recover DIR

``recover`` restarts healed, waits for full delivery and prints the rows of
ClickHouse's ``norm`` table as JSON: ``[[key, seq, count], ...]``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

from taproute.service import make_descriptors
from tests.park_child_setup import config, die, start
from tests.processors import SCHEMA

BATCHES, BATCH = 64, 16  # seq s has key s % 16: key 3 gets 64 records

CONFIG = config(
    "tests.park_keyed_processors",
    """
[[routes]]
name = "counts"
outputs = ["q"]
mode = "stateful"
processor = "park.keyed_count"
destination = "ch"
workers = 2

[routes.failure_policy]
deadline = 0.0
initial_backoff = 30.0
max_failures = 1000
failure_window = 3600.0
""",
)


def produce(directory: Path) -> None:
    os.environ["TAPROUTE_PARK_MODE"] = "fail"
    _, runtime = start(directory, CONFIG)
    q = runtime.bind_hook("q", layout="vec")
    vec = SCHEMA.layout_id("vec")
    for b in range(BATCHES):
        seqs = np.arange(b * BATCH, (b + 1) * BATCH)
        # Key 3's record in a batch of its own: only it fails (a failed call
        # parks every record of the call).
        for part in (seqs[seqs % 16 != 3], seqs[seqs % 16 == 3]):
            runtime.submit_batch(
                make_descriptors(q, 16, count=len(part), layout_ids=vec, keys=part % 16, seqs=part),
                np.zeros((len(part), 4), np.float32),
            )
    report = runtime.flush()
    assert report is not None
    account = report.routes["counts"]
    print(f"ack {BATCHES * BATCH - 1} parked {account.parked}", flush=True)
    die()


def recover(directory: Path) -> None:
    os.environ["TAPROUTE_PARK_MODE"] = "ok"
    built, runtime = start(directory, CONFIG)
    with built:
        runtime.flush(wait=True)
        runtime.stop()
    from taproute.service.sinks.clickhouse import ChdbTransport

    rows = ChdbTransport(directory / "chdb").query("SELECT key, seq, norm FROM norm").to_pylist()
    print(json.dumps([[int(r["key"]), int(r["seq"]), int(r["norm"])] for r in rows]), flush=True)


if __name__ == "__main__":
    command, directory = sys.argv[1:3]
    (produce if command == "produce" else recover)(Path(directory))
