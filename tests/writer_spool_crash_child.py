"""A child process for tests/test_writer_spool_crash.py: a service built from
a config file (chDB in a writer process, ``spool = "always"``) routes records
numbered from FIRST, printing ``ack N`` after each ``flush()`` returned
(every record with seq <= N is durable in the spool), until it is killed.

    python -m tests.writer_spool_crash_child produce CONFIG FIRST
    python -m tests.writer_spool_crash_child recover CONFIG

``recover`` starts the service again, waits until the spool has drained,
and prints the table's count, distinct seqs and its seqs in ranges as JSON.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from taproute.service import load_config, make_descriptors

BATCH = 32


def produce(runtime, first: int) -> None:
    hook = runtime.bind_hook("layers.0", layout="vec")
    layout = runtime.schema.layout_id("vec")
    seq = first
    while True:
        for _ in range(4):
            seqs = np.arange(seq, seq + BATCH)
            descriptors = make_descriptors(
                hook, 16, count=BATCH, keys=seqs, seqs=seqs, layout_ids=layout
            )
            runtime.submit_batch(descriptors, np.ones((BATCH, 4), np.float32))
            seq += BATCH
        runtime.flush()
        print(f"ack {seq - 1}", flush=True)


def main(action: str, path: str, first: str = "0") -> None:
    config = load_config(path)
    with config.build() as built:
        runtime = built.start()
        if action == "produce":
            produce(runtime, int(first))
        report = runtime.flush(wait=True)
        assert report is not None and report.fully_delivered, report
        runtime.close()
    from taproute.service.sinks.clickhouse import ChdbTransport

    data = config.destinations["ch"].path_under(config.source.parent)
    transport = ChdbTransport(data)
    table = transport.query("SELECT seq FROM raw_vec ORDER BY seq")
    transport.close()
    seqs = table.column("seq").to_pylist()
    print(json.dumps({"count": len(seqs), "distinct": len(set(seqs)), "seqs": seqs}))


if __name__ == "__main__":
    main(*sys.argv[1:])
