"""Every record ``submit()`` accepted is counted somewhere once the runtime
latches its first failure: real writer process, real chDB, killed with SIGKILL.

Nothing waits by sleeping: the stall is read from the counters (a producer
blocked in ``submit``), the writer's exit is awaited on its pidfd.
"""

from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from taproute.native import make_descriptors
from taproute.routing import Layout, RecordSchema, Route, RoutingConfig
from taproute.routing.errors import RoutingFailure
from taproute.service import RoutingSink, create_record_runtime
from taproute.service.host.metrics import SnapshotCollector
from taproute.service.sinks.clickhouse import Batching
from taproute.service.sinks.writer import WriterProcessSink
from tests.test_runtime import eventually
from tests.test_writer_process import _exited

ACTS = Layout("acts", [("values", "Array(Float32)")])
SCHEMA = RecordSchema([ACTS])
WIDTH = 16
RECORDS = 4  # per batch
NBYTES = RECORDS * WIDTH * 4


def _submit(runtime, hook: int, step: int) -> None:
    """One batch of RECORDS records of WIDTH floats, all equal to ``step``."""
    payload = np.full(RECORDS * WIDTH, step, dtype=np.float32).view(np.uint8)
    descriptors = make_descriptors(
        hook,
        np.full(RECORDS, WIDTH * 4),
        offsets=np.arange(RECORDS) * WIDTH * 4,
        layout_ids=runtime.schema.layout_id("acts"),
        keys=np.arange(RECORDS),
        steps=step,
    )
    runtime.submit_batch(descriptors, payload, None)


def test_records_accepted_when_the_writer_dies_for_good_are_all_counted(tmp_path):
    """The writer process dies past ``restarts`` while the stages in front of
    it are full: the sink's submit waits for room, ingress is full, a
    producer is blocked in ``submit``.  The failure
    is latched; then what ingress held was released uncounted (the record
    worker skipped it), and the batches the destination handed to the dead
    sink counted only as ``errors`` (calls), not as records: the counts
    fell short of what ``submit()`` had accepted.  Now the records delivered,
    given up by the sink, failed at the destination (``failed_records``) and
    given up at ingress (``given_up``) add up to exactly what was accepted,
    both new counts are on /metrics, and what is counted delivered is what
    ClickHouse holds."""
    batching = Batching(max_rows=2 * RECORDS, max_buffered_bytes=4 * NBYTES, linger=3600)
    sink = WriterProcessSink.embedded(
        SCHEMA, tmp_path / "data", raw=["acts"], restarts=0, batching=batching
    )
    routing = RoutingSink(
        RoutingConfig([Route("to_ch", "h.*", "ch")]),
        SCHEMA,
        {"ch": lambda: sink},
        unmatched="drop",
        destination_capacity=4 * RECORDS,
    )
    runtime = create_record_runtime(record_sink=routing, capacity_records=16 * RECORDS)
    pid = sink.writer_pid
    assert pid is not None
    accepted = 0
    refused: list[BaseException] = []

    def produce() -> None:
        nonlocal accepted
        for step in range(2, 100_000):
            try:
                _submit(runtime, hook, step)
            except RoutingFailure as exc:
                refused.append(exc)
                return
            accepted += RECORDS

    producer = threading.Thread(target=produce)
    try:
        hook = runtime.bind_hook("h.0", layout="acts")
        _submit(runtime, hook, 1)  # delivered: persisted before anything fails
        accepted += RECORDS
        runtime.flush()
        os.kill(pid, signal.SIGSTOP)  # nothing more is persisted: every stage fills
        producer.start()
        eventually(lambda: runtime.counters().ingress.blocked_producers == 1)
        # Ingress is full behind a sink submit waiting for room (made by the
        # destination actor, or by the record worker itself when it was idle).
        assert runtime.counters().ingress.queued > 0
        os.kill(pid, signal.SIGKILL)
        producer.join(60)
        assert not producer.is_alive() and refused, "the producer was not refused"
        assert "killed by SIGKILL" in str(refused[0])
    finally:
        with pytest.raises(RoutingFailure, match="killed by SIGKILL"):
            runtime.close()
    assert _exited(pid)

    snap = runtime.counters()
    ingress, route, ch = snap.ingress, snap.routes["to_ch"], snap.destinations["ch"]
    assert ingress.submitted == accepted
    # Nothing waits anywhere any more.
    assert ingress.queued == route.backlog == route.parked == ch.queue_depth == 0
    # Both places that let records go at the latch did let some go, counted.
    assert ingress.given_up > 0 and ch.failed_records > 0
    delivered = ch.records - ch.given_up_records
    counted = {
        "delivered": delivered,
        "given up by the sink (taken, lost with the writer)": ch.given_up_records,
        "failed at the destination (submit raised)": ch.failed_records,
        "abandoned at the destination": ch.abandoned_records,
        "failed in the route (dead-lettered)": route.failed,
        "dropped in the route": route.dropped,
        "abandoned in the route": route.abandoned,
        "given up at ingress (the runtime had failed)": ingress.given_up,
        "abandoned at ingress": ingress.abandoned,
        "unmatched, dropped": snap.unmatched_dropped,
    }
    assert sum(counted.values()) == accepted, counted
    # Per stage: what ingress accepted reached the route or was given up
    # there; what the forward route took reached the sink or failed there.
    assert route.accepted + ingress.given_up + ingress.abandoned == accepted
    assert route.accepted == ch.records + ch.failed_records + ch.abandoned_records
    # What is counted delivered is what ClickHouse holds.
    rows = sink.query("SELECT count() AS n FROM raw_acts").to_pylist()
    assert rows == [{"n": delivered}] and delivered == RECORDS

    registry = CollectorRegistry()
    registry.register(SnapshotCollector(runtime.counters))
    scraped = generate_latest(registry).decode()
    assert f"taproute_ingress_given_up_records_total {float(ingress.given_up)}" in scraped
    assert (
        f'taproute_destination_failed_records_total{{destination="ch"}} '
        f"{float(ch.failed_records)}" in scraped
    )
