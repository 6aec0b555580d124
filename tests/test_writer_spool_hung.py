"""A writer process that stops answering (hung in an insert; here SIGSTOP)
under an ``"outage"`` spool: a flush waits for its inserts at most the
writer sink's ``flush_timeout``, then hands them to the spool under their tokens
and returns; the destination is reported unhealthy meanwhile, and what was
spooled arrives exactly once when the writer answers again.

Before, ``SpoolingSink.flush`` waited on the writer's blocks for as long as
it stayed hung (a probe's ``runtime.flush(timeout=40)`` ran out with the
writer stopped) while ``/status`` said the destination was healthy, with an
empty spool: the README's "flush() ... does not wait for an outage to end"
held for the in-process ClickHouse sink (its ``close_timeout``), not for a
writer process.  Real chDB in a real writer process, a real GPT-2 (random
weights) for the runtime case; nothing waits by sleeping: the writer's
stop is seen in its blocks' states."""

from __future__ import annotations

import os
import signal

import torch
import trio

from taproute.routing import HookRegistry, RecordSchema, Route, RoutingConfig
from taproute.service import RoutingSink, create_record_runtime
from taproute.service.capture import bind_modules, capture_context
from taproute.service.sinks.clickhouse import Batching
from taproute.service.sinks.spool import Spool, SpoolConfig
from taproute.service.sinks.spool.spooling import Backoff, SpoolingSink
from taproute.service.sinks.writer import WriterProcessSink
from tests.capture_models import ACTS, VOCAB, gpt2
from tests.conftest import vec_batch
from tests.processors import SCHEMA
from tests.test_writer_spool import GUARD_S, counts, guarded, in_flight, wait_for


def spooled(tmp_path, schema, raw, hooks=None, **options) -> SpoolingSink:
    writer = WriterProcessSink.embedded(
        schema, tmp_path / "data", raw=raw, hooks=hooks, flush_timeout=0.5, **options
    )
    return SpoolingSink(
        "ch",
        writer,
        Spool.open(SpoolConfig(directory=tmp_path / "spool")),
        mode="outage",
        backoff=Backoff(initial=0.01, maximum=0.05),
    )


async def test_a_flush_hands_a_hung_writers_blocks_to_the_spool_after_flush_timeout(tmp_path):
    hooks = HookRegistry()
    hooks.bind("q", layout="vec")
    # One block per batch (max_rows=4), so some are at the writer when it hangs.
    sink = spooled(tmp_path, SCHEMA, ["vec"], hooks, batching=Batching(max_rows=4))
    writer = sink.inner
    assert isinstance(writer, WriterProcessSink)
    # The healthy writer gets as long as it needs: with the 0.5 s from the
    # start, a first insert slower than that (a loaded machine) made the
    # first flush hand its block to the spool too, and the counts below
    # (20 appended) were off by it.
    writer.flush_timeout = GUARD_S
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        await sink.submit(vec_batch(0, 4))
        await sink.flush()  # the healthy writer persisted it: the batched path
        assert sink.health.healthy and sink.snapshot().spool.appended_records == 0
        assert sink.counters.delivered_records == 4
        pid = writer.writer_pid
        assert pid is not None
        writer.flush_timeout = 0.5  # from here the writer never answers in time
        os.kill(pid, signal.SIGSTOP)
        try:
            for i in range(1, 6):
                await sink.submit(vec_batch(0, 4, seq_start=4 * i))
            await wait_for(lambda: in_flight(writer, direct=False))
            with trio.fail_after(GUARD_S):  # waited for the stopped writer for good
                await sink.flush()
            assert sink.failure is None and writer.failure is None
            health = sink.health
            assert not health.healthy
            assert health.reason is not None
            assert "no answer within 0.5 s (flush_timeout)" in health.reason
            snapshot = sink.snapshot()
            assert snapshot.spool.appended_records == 20  # every record it held, durable
            assert snapshot.memory_records == 0
            # A block the writer was sent keeps its shared buffers: it may read them.
            assert writer._abandoned
        finally:
            os.kill(pid, signal.SIGCONT)
        # Answering again, though maybe slowly on a loaded machine: waited for.
        writer.flush_timeout = GUARD_S
        with guarded(sink):
            await sink.wait_delivered()
            # The writer inserted what it had been sent, the spool the same
            # blocks under the same tokens: every record once.
            assert await counts(writer) == {"n": 24, "u": 24, "lo": 0, "hi": 23}
            assert sink.health.healthy
            assert sink.counters.delivered_records == 24
            assert not writer._abandoned  # given back once the writer answered
            assert writer.counters.crashes == 0
            await sink.close()


def test_a_hung_writer_costs_the_model_nothing_and_a_runtime_flush_returns(tmp_path):
    """From the model's side: GPT-2 hooks copying into the writer's shared
    memory; the writer stops; every forward pass runs without an exception
    and without waiting on ingress, ``runtime.flush()`` returns (it waited
    for the writer for good), ``/status``' counters say unhealthy, and
    after the writer goes on every captured record is in chDB once."""
    schema = RecordSchema([ACTS])
    sink = spooled(tmp_path, schema, ["acts"])
    writer = sink.inner
    assert isinstance(writer, WriterProcessSink)
    routing = RoutingSink(
        RoutingConfig([Route("raw", "*", "ch")]), schema, {"ch": lambda: sink}, unmatched="drop"
    )
    model = gpt2()
    ids = torch.randint(3, VOCAB, (4, 8))
    runtime = create_record_runtime(record_sink=routing, max_block=5.0)
    pid = None
    try:
        bind_modules(runtime, model, "transformer.h.*.mlp", layout="acts", pool=writer.buffer_pool)
        keys = iter(range(10_000))

        def forward() -> None:
            with torch.inference_mode(), capture_context([next(keys) for _ in range(4)]):
                model(ids)

        forward()
        runtime.flush()
        pid = writer.writer_pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        for _ in range(10):
            forward()  # never raises
        runtime.flush(timeout=GUARD_S)  # TimeoutError before: it waited for the writer
        destination = runtime.counters().destinations["ch"]
        assert destination.healthy is False
        assert "no answer within 0.5 s" in (destination.unhealthy_reason or "")
        assert destination.records == 11 * 4 * 2  # passes x rows x hooks: all accepted
        ingress = runtime.counters().ingress
        assert ingress.shed == 0 and not ingress.dropped and ingress.blocked_seconds == 0
        os.kill(pid, signal.SIGCONT)
        pid = None
        forward()
        runtime.flush(timeout=GUARD_S, wait=True)  # and the spool has drained
        assert runtime.counters().destinations["ch"].healthy is True
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
        runtime.close()
    rows = writer.query("SELECT count() AS n, uniqExact(key, output_id) AS u FROM raw_acts")
    assert rows.to_pylist() == [{"n": 12 * 4 * 2, "u": 12 * 4 * 2}]
