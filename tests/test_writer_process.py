"""ClickHouse in a writer process (WriterProcessSink): real processes, real
chDB, real shared memory; writers killed with SIGKILL.

Nothing here waits by sleeping: a flush returns when the writer has
persisted, a process's exit is awaited on its pidfd."""

from __future__ import annotations

import functools
import gc
import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import trio
import trio.testing

from taproute.native import make_descriptors
from taproute.routing import Layout, RecordBatch, RecordSchema
from taproute.routing.errors import ConfigError, RoutingFailure
from taproute.service import create_record_runtime
from taproute.service.capture import CaptureWarning, bind_modules, capture_context
from taproute.service.sinks.clickhouse import SchemaMismatch
from taproute.service.sinks.writer import (
    DirectoryInUse,
    SharedBufferPool,
    WriterCrashed,
    WriterProcessSink,
)
from taproute.service.sinks.writer.process import WriterProcess
from taproute.service.sinks.writer.protocol import Done, Insert, RawItem, WriterConfig
from tests.capture_models import gpt2

ACTS = Layout("acts", [("values", "Array(Float32)")])
VEC = Layout("vec", [("values", "Array(Float32)", (4,))])
SCHEMA = RecordSchema([ACTS])
WIDTH = 16


def _exited(pid: int, timeout: float = 60.0) -> bool:
    """True once process ``pid`` has exited (waits on its pidfd, at most ``timeout``)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        ready, _, _ = select.select([fd], [], [], timeout)
        return bool(ready)
    finally:
        os.close(fd)


def _memfd_mappings() -> list[str]:
    maps = Path("/proc/self/maps").read_text().splitlines()
    fds = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd") if _link(fd)]
    return [m for m in maps if "taproute-writer" in m] + [f for f in fds if "taproute-writer" in f]


def _link(fd: str) -> bool:
    try:
        os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return False
    return True


def _submit(runtime, sink: WriterProcessSink, output_id: int, step: int, *, shared: bool = True):
    """Four records of WIDTH floats, all equal to ``step``; in the sink's shared
    pool (``shared``) or in a private array."""
    nbytes = 4 * WIDTH * 4
    if shared:
        buffer = sink.buffer_pool.take_array(nbytes)
        payload = buffer[:nbytes]
        release = lambda: sink.buffer_pool.give_back(buffer)  # noqa: E731
    else:
        payload = np.empty(nbytes, dtype=np.uint8)
        release = None
    payload.view(np.float32)[:] = step
    descriptors = make_descriptors(
        output_id,
        np.full(4, WIDTH * 4),
        offsets=np.arange(4) * WIDTH * 4,
        layout_ids=runtime.schema.layout_id("acts"),
        keys=np.arange(4),
        steps=step,
    )
    runtime.submit_batch(descriptors, payload, release)


def _totals(sink) -> tuple[int, float, int]:
    row = sink.query(
        "SELECT count() AS n, sum(arraySum(values)) AS total, uniqExact(step) AS steps "
        "FROM raw_acts"
    ).to_pylist()[0]
    return int(row["n"]), float(row["total"]), int(row["steps"])


def _expected(steps: range) -> tuple[int, float, int]:
    return 4 * len(steps), float(sum(4 * WIDTH * s for s in steps)), len(steps)


def test_rows_land_exactly_read_through_the_writer_then_locally(tmp_path):
    sink = WriterProcessSink.embedded(SCHEMA, tmp_path / "data", raw=["acts"])
    pid = sink.writer_pid
    assert pid is not None and pid != os.getpid()
    with create_record_runtime(record_sink=sink) as runtime:
        hook = runtime.bind_hook("h.0", layout="acts")
        for step in range(1, 11):
            _submit(runtime, sink, hook, step)
        _submit(runtime, sink, hook, 11, shared=False)
        runtime.flush()
        # While the writer holds the chDB directory, reads go through it.
        assert _totals(sink) == _expected(range(1, 12))
        counters = sink.counters
        assert counters.records == 44
        assert counters.shared_bytes == 10 * 4 * WIDTH * 4  # by reference
        assert counters.copied_bytes == 4 * WIDTH * 4  # the private one, copied once
        hooks = sink.query("SELECT DISTINCT hook FROM raw_acts").to_pylist()
        assert hooks == [{"hook": "h.0"}]
    # Closed: the writer released the directory, this process opens it.
    assert _exited(pid, timeout=0)
    assert _totals(sink) == _expected(range(1, 12))


def test_capture_hooks_write_into_the_shared_pool_without_copies(tmp_path):
    model = gpt2()
    ids = torch.randint(3, 100, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    sink = WriterProcessSink.embedded(SCHEMA, tmp_path / "data", raw=["acts"])
    with create_record_runtime(record_sink=sink) as runtime:
        bind_modules(
            runtime,
            model,
            "transformer.h.?",
            layout="acts",
            pool=sink.buffer_pool,
            on_error="raise",
        )
        with torch.inference_mode(), capture_context([7, 8], attention_mask=mask):
            out = model(ids, attention_mask=mask, output_hidden_states=True)
        runtime.flush()
        rows = sink.query(
            "SELECT hook, key, values, values_shape FROM raw_acts WHERE hook = 'transformer.h.0' "
            "ORDER BY key"
        ).to_pylist()
        assert sink.counters.copied_bytes == 0
        assert sink.counters.shared_bytes > 0
    hidden = out.hidden_states[1]  # the output of block 0
    assert [r["key"] for r in rows] == [7, 8]
    for i, row in enumerate(rows):
        assert row["values_shape"] == [6, 32]
        np.testing.assert_array_equal(
            np.asarray(row["values"], dtype=np.float32).reshape(6, 32), hidden[i].numpy()
        )


def test_sigkilled_writer_is_restarted_and_nothing_is_lost_or_doubled(tmp_path):
    sink = WriterProcessSink.embedded(SCHEMA, tmp_path / "data", raw=["acts"])
    with create_record_runtime(record_sink=sink) as runtime:
        hook = runtime.bind_hook("h.0", layout="acts")
        for step in range(1, 6):
            _submit(runtime, sink, hook, step)
        runtime.flush()
        first = sink.writer_pid
        assert first is not None
        for step in range(6, 11):
            _submit(runtime, sink, hook, step)
        os.kill(first, signal.SIGKILL)
        for step in range(11, 16):
            _submit(runtime, sink, hook, step)
        runtime.flush()  # returns once the restarted writer persisted everything
        assert sink.counters.crashes == 1
        assert sink.counters.restarts == 1
        assert sink.writer_pid not in (None, first)
        assert sink.health.healthy
        assert _totals(sink) == _expected(range(1, 16))
    assert _exited(first)


def test_a_block_resent_after_a_crash_is_written_once(tmp_path):
    """The case a restart relies on: the first writer persisted the block, but
    died before its answer arrived; the next one gets the same block and token."""
    config = WriterConfig(kind="chdb", where=str(tmp_path / "data"), schema=SCHEMA, raw=("acts",))
    pool = SharedBufferPool()
    payload = pool.take_array(4 * WIDTH * 4)[: 4 * WIDTH * 4]
    payload.view(np.float32)[:] = 3
    ref = pool.locate(payload)
    assert ref is not None
    descriptors = make_descriptors(
        0, np.full(4, WIDTH * 4), offsets=np.arange(4) * WIDTH * 4, layout_ids=0, keys=np.arange(4)
    )
    from taproute.service.sinks.writer.protocol import HookTable

    insert = Insert(
        1,
        "fixed-token",
        [RawItem(ref.segment, ref.offset, payload.nbytes, descriptors)],
        HookTable(("h.0",), {}),
    )

    async def insert_once() -> tuple[object, int]:
        process = await trio.to_thread.run_sync(WriterProcess.start, config, 120.0)
        stream = process.attach()
        await process.hand_segment(pool, ref.segment)
        await stream.send(insert)
        reply = await stream.receive()
        code = await trio.to_thread.run_sync(process.kill)  # no goodbye: a crash
        await process.aclose()
        return reply, code

    first, code = trio.run(insert_once)
    assert first == Done(1)
    assert code == -signal.SIGKILL
    second, _ = trio.run(insert_once)
    assert second == Done(1)
    pool.close()
    reader = WriterProcessSink.embedded(SCHEMA, tmp_path / "data", raw=["acts"])
    try:
        assert reader.query("SELECT count() AS n FROM raw_acts").to_pylist() == [{"n": 4}]
    finally:
        reader.close_unstarted()


def test_a_writer_that_keeps_dying_latches_and_hooks_never_raise(tmp_path):
    model = gpt2()
    ids = torch.randint(3, 100, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    sink = WriterProcessSink.embedded(SCHEMA, tmp_path / "data", raw=["acts"], restarts=0)
    runtime = create_record_runtime(record_sink=sink)
    try:
        bindings = bind_modules(
            runtime, model, "transformer.h.?", layout="acts", pool=sink.buffer_pool
        )
        with torch.inference_mode(), capture_context([1, 2], attention_mask=mask):
            model(ids, attention_mask=mask)
        pid = sink.writer_pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(RoutingFailure) as raised:
            runtime.flush()
        assert isinstance(raised.value.cause, WriterCrashed)
        assert "was killed by SIGKILL" in str(raised.value)
        assert sink.counters.crashes == 1 and sink.counters.restarts == 0
        assert not sink.health.healthy and "SIGKILL" in (sink.health.reason or "")
        # The model keeps running: the hooks detach and count, never raise.
        with (
            pytest.warns(CaptureWarning, match="detached"),
            torch.inference_mode(),
            capture_context([1, 2], attention_mask=mask),
        ):
            model(ids, attention_mask=mask)
        assert all(binding.detached for binding in bindings)
    finally:
        with pytest.raises(RoutingFailure):
            runtime.close()
    assert _exited(pid)


def test_rows_lost_with_a_writer_that_died_for_good_are_counted_given_up(tmp_path):
    """A writer killed past ``restarts`` latches the failure; the rows it had
    been sent and had not persisted were lost without a count (the
    destination's given_up_records said 0).  Now sent = persisted + given up."""
    from taproute.routing import Route, RoutingConfig
    from taproute.service import RoutingSink
    from tests.test_runtime import eventually

    sink = WriterProcessSink.embedded(SCHEMA, tmp_path / "data", raw=["acts"], restarts=0)
    routing = RoutingSink(
        RoutingConfig([Route("to_ch", "h.*", "ch")]), SCHEMA, {"ch": lambda: sink}, unmatched="drop"
    )
    runtime = create_record_runtime(record_sink=routing)
    pid = sink.writer_pid
    assert pid is not None
    try:
        hook = runtime.bind_hook("h.0", layout="acts")
        _submit(runtime, sink, hook, 1, shared=False)
        runtime.flush()
        os.kill(pid, signal.SIGSTOP)  # nothing more is persisted
        for step in range(2, 5):
            _submit(runtime, sink, hook, step, shared=False)
        eventually(lambda: sink.counters.buffered_rows + sink.counters.in_flight_rows == 12)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(RoutingFailure, match="killed by SIGKILL"):
            runtime.flush()
        assert runtime.counters().destinations["ch"].given_up_records == 12
        assert sink.counters.records == 4 and sink.counters.abandoned_rows == 12
        assert sink.counters.buffered_rows == sink.counters.in_flight_rows == 0
    finally:
        with pytest.raises(RoutingFailure):
            runtime.close()
    assert _exited(pid)
    assert sink.query("SELECT count() AS n FROM raw_acts").to_pylist() == [{"n": 4}]


def test_an_insert_the_writer_refuses_latches_with_its_reason(tmp_path):
    sink = WriterProcessSink.embedded(SCHEMA, tmp_path / "data", raw=["acts"])
    with (
        pytest.raises(RoutingFailure, match="UNKNOWN_TABLE|does not exist"),
        create_record_runtime(record_sink=sink) as runtime,
    ):
        hook = runtime.bind_hook("h.0", layout="acts")
        sink.query("DROP TABLE raw_acts")
        _submit(runtime, sink, hook, 1)
        runtime.flush()
    assert sink.counters.errors == 1 and sink.counters.retries == 0
    assert sink.counters.crashes == 0


def test_clean_shutdown_leaves_no_process_and_no_shared_segment(tmp_path):
    gc.collect()  # what earlier tests left to the collector
    before = _memfd_mappings()
    sink = WriterProcessSink.embedded(SCHEMA, tmp_path / "data", raw=["acts"])
    pid = sink.writer_pid
    with create_record_runtime(record_sink=sink) as runtime:
        hook = runtime.bind_hook("h.0", layout="acts")
        for step in range(3):
            _submit(runtime, sink, hook, step)
        runtime.flush()
        assert len(_memfd_mappings()) > len(before)
    assert pid is not None and _exited(pid, timeout=0)  # reaped by close, not later
    assert sink.writer_pid is None
    assert _memfd_mappings() == before


def test_a_killed_model_process_leaves_no_writer_behind(tmp_path):
    script = textwrap.dedent(
        f"""
        import sys
        from taproute.routing import Layout, RecordSchema
        from taproute.service.sinks.writer import WriterProcessSink
        schema = RecordSchema([Layout("acts", [("values", "Array(Float32)")])])
        sink = WriterProcessSink.embedded(schema, {str(tmp_path / "data")!r}, raw=["acts"])
        print(sink.writer_pid, flush=True)
        sys.stdin.read()
        """
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    writer = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    assert _exited(writer), "the writer outlived its model process"


def test_table_errors_come_from_the_writer_at_construction(tmp_path):
    other = RecordSchema([Layout("acts", [("values", "Array(Int32)")])])
    sink = WriterProcessSink.embedded(SCHEMA, tmp_path / "data", raw=["acts"])
    trio.run(sink.close)
    with pytest.raises(SchemaMismatch, match="raw_acts"):
        WriterProcessSink.embedded(other, tmp_path / "data", raw=["acts"])


def test_one_process_per_chdb_directory_is_explained(chdb_transport):
    # This process holds chdb_transport's directory (chDB's status lock).
    with pytest.raises(DirectoryInUse, match="one process per directory"):
        WriterProcessSink.embedded(SCHEMA, chdb_transport.path, raw=["acts"])


def test_shared_pool_reuses_buffers_and_locates_them():
    pool = SharedBufferPool(segment_bytes=1 << 20)
    tensor = pool.take(5000)  # rounded up to 8 KiB
    assert tensor.numel() == 8192
    array = pool.take_array(100)
    assert pool.locate(array) is not None
    assert pool.locate(tensor.numpy()[4096:]).offset == pool.locate(tensor.numpy()).offset + 4096
    assert pool.locate(np.zeros(10, dtype=np.uint8)) is None
    pool.give_back(tensor)
    assert pool.take(8000) is tensor  # the same buffer again, no new one
    assert pool.outstanding == 2 and pool.allocated == 2 and pool.segments == 1
    pool.take_array(2 << 20)  # bigger than a segment: a segment of its own
    assert pool.segments == 2
    pool.close()
    private = pool.take(100)
    assert pool.locate(private.numpy()) is None
    pool.give_back(private)  # ignored: not the pool's


def test_a_sink_never_run_answers_queries_and_closes_its_writer(tmp_path):
    sink = WriterProcessSink.embedded(SCHEMA, tmp_path / "data", raw=["acts"])
    pid = sink.writer_pid
    assert pid is not None
    assert sink.query("SELECT count() AS n FROM raw_acts").to_pylist() == [{"n": 0}]
    trio.run(sink.close)
    assert _exited(pid, timeout=0)


CONFIG = """
processors = ["tests.processors"]

[[layouts]]
name = "vec"
columns = [{ name = "values", type = "Array(Float32)", shape = [4] }]

[[routes]]
name = "raw"
outputs = ["layers.*"]
destination = "ch"

[destinations.ch]
path = "data"
raw = ["vec"]
writer = "process"
spool = "@SPOOL@"

[routing]
unmatched = "drop"

[[producer.hooks]]
name = "layers.0"
layout = "vec"
batch = 16
"""


@pytest.mark.parametrize("spool", ["off", "outage", "always"])
def test_a_config_file_destination_in_a_writer_process(tmp_path, capsys, spool):
    from taproute.service.host.cli import main as cli_main
    from taproute.service.host.config import load_config

    path = tmp_path / "router.toml"
    path.write_text(CONFIG.replace("@SPOOL@", spool))
    assert cli_main(["check", "--config", str(path)]) == 0
    assert "checked by a writer process" in capsys.readouterr().out
    config = load_config(path)
    with config.build() as built, built.start() as service:
        output_id = service.bind_hook("layers.0")
        values = np.arange(32, dtype=np.float32)
        descriptors = make_descriptors(
            output_id, np.full(8, 16), offsets=np.arange(8) * 16, layout_ids=0, keys=np.arange(8)
        )
        service.submit_batch(descriptors, values)
        service.flush(wait=True)
    # The spool sits beside the chDB directory, in this process.
    assert (tmp_path / "data-spool" / "ch").is_dir() == (spool != "off")
    reader = WriterProcessSink.embedded(RecordSchema([VEC]), tmp_path / "data", raw=["vec"])
    try:
        got = reader.query("SELECT count() AS n, sum(arraySum(values)) AS s FROM raw_vec")
        assert got.to_pylist() == [{"n": 8, "s": float(values.sum())}]
    finally:
        reader.close_unstarted()


async def test_close_while_a_replacement_writer_starts_stops_and_reaps_it(tmp_path, monkeypatch):
    """The writer dies; while its replacement starts, the sink is closed: the
    replacement is killed, reaped and its sockets closed before close() returns
    (it used to be left running, unreaped, with its sockets open)."""
    from taproute.service.sinks.clickhouse import Retry

    real_start = WriterProcess.start
    replacements: list[WriterProcess] = []
    starting, release = threading.Event(), threading.Event()

    def start(config: WriterConfig, timeout: float) -> WriterProcess:
        if not replacements and starting.is_set():
            raise AssertionError("only one replacement expected")
        starting.set()
        process = real_start(config, timeout)
        replacements.append(process)
        assert release.wait(60), "the test never released the replacement"
        return process

    sink = WriterProcessSink.embedded(
        SCHEMA, tmp_path / "data", raw=["acts"], retry=Retry(initial_backoff=0.001)
    )
    first = sink.writer_pid
    assert first is not None
    monkeypatch.setattr(WriterProcess, "start", staticmethod(start))
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(sink.run)
            os.kill(first, signal.SIGKILL)
            assert await trio.to_thread.run_sync(starting.wait, 60)
            closed = trio.Event()

            async def close() -> None:
                await sink.close()
                closed.set()

            nursery.start_soon(close)
            await trio.testing.wait_all_tasks_blocked()  # close() has marked the sink closing
            assert not closed.is_set()  # it waits for the replacement to be stopped
            release.set()
            with trio.fail_after(60):  # a hang guard only
                await closed.wait()
            [replacement] = replacements
            # Reaped (not a zombie) and its sockets closed, by the time close() returned.
            assert replacement.process.returncode == -signal.SIGKILL
            assert replacement._messages.fileno() == -1
            assert replacement._segments.fileno() == -1
        assert sink.counters.crashes == 1 and sink.counters.restarts == 0
        assert sink.writer_pid is None
    finally:
        release.set()
        for process in replacements:
            if process.process.poll() is None:
                process.kill()
            process.close_sockets()


def test_a_done_handled_before_the_send_returned_counts(tmp_path, monkeypatch):
    """The writer may persist a block and its Done be handled while the
    sender's send of that block has not returned yet (the sender waits for the
    socket, or on a loaded machine for a core): the Done counts and flush()
    returns.  It used to be taken for a stray answer (the block was marked
    sent only after the send returned), and flush() waited for good; seen in
    the bench once the last block no longer queued behind the one in flight."""
    from taproute.service.sinks.writer import protocol

    answered: dict[int, trio.Event] = {}

    def event(block: int) -> trio.Event:
        return answered.setdefault(block, trio.Event())

    real_send = protocol.MessageStream.send

    async def send_returning_after_the_answer(self, message: object) -> None:
        await real_send(self, message)
        if isinstance(message, Insert):  # return only once the writer's answer was handled
            await event(message.block).wait()

    monkeypatch.setattr(protocol.MessageStream, "send", send_returning_after_the_answer)
    sink = WriterProcessSink.embedded(SCHEMA, tmp_path / "data", raw=["acts"])
    handle = sink._on_message

    def on_message(message: object) -> None:
        handle(message)
        if isinstance(message, Done):
            event(message.block).set()

    sink._on_message = on_message  # type: ignore[method-assign]
    runtime = create_record_runtime(record_sink=sink)
    try:
        hook = runtime.bind_hook("h.0", layout="acts")
        for step in range(1, 4):
            _submit(runtime, sink, hook, step)
        runtime.flush(timeout=60)  # a hang guard: it waited for good before the fix
        assert sink.counters.blocks == 1
        assert sink.counters.in_flight_rows == 0
        assert _totals(sink) == _expected(range(1, 4))
    finally:
        pid = sink.writer_pid
        if sink.counters.in_flight_rows and pid is not None:
            os.kill(pid, signal.SIGKILL)  # a stuck block: a restart re-sends it, close can end
        runtime.close()


def step_batch(hook: int, step: int) -> RecordBatch:
    """Four records of ``acts`` from ``hook``, keys 0-3, every value ``step``."""
    descriptors = make_descriptors(
        hook,
        np.full(4, WIDTH * 4),
        offsets=np.arange(4) * WIDTH * 4,
        layout_ids=SCHEMA.layout_id("acts"),
        keys=np.arange(4),
        steps=step,
    )
    return RecordBatch.from_buffer(descriptors, np.full(4 * WIDTH, step, dtype=np.float32))


def _sink_of_step_batches(tmp_path, batching):
    """A writer sink with ``batching`` and hook ``h.0`` bound, and a maker of
    that hook's batches: 4 records of ``acts`` per step, every value the step."""
    from taproute.routing import HookRegistry

    sink = WriterProcessSink.embedded(SCHEMA, tmp_path / "data", raw=["acts"], batching=batching)
    hooks = HookRegistry()
    hook = hooks.bind("h.0", layout="acts")
    sink.use_hooks(hooks)

    return sink, functools.partial(step_batch, hook)


async def test_a_producer_waiting_for_room_gets_a_block_sent_not_the_linger(tmp_path):
    """With ``max_buffered_bytes`` below ``max_bytes`` and no early seal, the
    buffer reaches the room limit with no block at the writer: a submit
    waiting for room seals it, instead of waiting for the linger (an hour)."""
    from taproute.service.sinks.clickhouse import Batching

    nbytes = 4 * WIDTH * 4
    batching = Batching(max_bytes=100 * nbytes, max_buffered_bytes=2 * nbytes, linger=3600)
    sink, batch = _sink_of_step_batches(tmp_path, batching)
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        with trio.fail_after(60):  # the linger would take an hour
            for step in range(1, 6):
                await sink.submit(batch(step))
        assert sink.counters.blocks >= 1  # made room: a block was persisted before the linger
        await sink.flush()
        await sink.close()
    assert _totals(sink) == _expected(range(1, 6))


async def test_a_block_is_sealed_early_while_none_is_at_the_writer(tmp_path):
    """With no block at the writer, a buffer becomes one at ``early_bytes``;
    while one is there, the buffer fills towards ``max_bytes``."""
    from taproute.service.sinks.clickhouse import Batching

    nbytes = 4 * WIDTH * 4
    batching = Batching(early_bytes=3 * nbytes, max_bytes=100 * nbytes, linger=3600)
    sink, batch = _sink_of_step_batches(tmp_path, batching)
    counters = sink.counters
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        for step in (1, 2):
            await sink.submit(batch(step))
        assert (counters.buffered_rows, counters.in_flight_rows) == (8, 0)
        await sink.submit(batch(3))  # early_bytes, no block at the writer: sealed
        assert (counters.buffered_rows, counters.in_flight_rows) == (0, 12)
        for step in range(4, 8):  # no checkpoint: that block is still at the writer
            await sink.submit(batch(step))
        assert (counters.buffered_rows, counters.in_flight_rows) == (16, 12)
        await sink.flush()
        assert counters.blocks == 2
        await sink.close()
    assert _totals(sink) == _expected(range(1, 8))


def _niceness_of_threads(pid: int) -> list[int]:
    """Each thread's niceness (field 19 of /proc/<pid>/task/<tid>/stat), but
    chDB's MemoryWorker's: it raises its own priority (it samples memory
    counters, and does little else)."""
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            stat = f.read()
        if stat[stat.index("(") + 1 : stat.rindex(")")] != "MemoryWorker":
            out.append(int(stat[stat.rindex(")") + 2 :].split()[16]))
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux)")
def test_nice_lowers_every_writer_thread_and_survives_a_restart(tmp_path):
    """nice=N: every thread of the writer (chDB's included) runs N steps nicer
    than this process, and so does a writer started after a crash; the rows
    still land exactly."""
    own = os.getpriority(os.PRIO_PROCESS, 0)
    sink = WriterProcessSink.embedded(SCHEMA, tmp_path / "data", raw=["acts"], nice=7)
    with create_record_runtime(record_sink=sink) as runtime:
        hook = runtime.bind_hook("h.0", layout="acts")
        _submit(runtime, sink, hook, 0)
        runtime.flush()
        first = sink.writer_pid
        assert first is not None
        threads = _niceness_of_threads(first)
        assert len(threads) > 1 and set(threads) == {min(own + 7, 19)}
        os.kill(first, signal.SIGKILL)
        _submit(runtime, sink, hook, 1)
        runtime.flush()
        second = sink.writer_pid
        assert second is not None and second != first
        assert set(_niceness_of_threads(second)) == {min(own + 7, 19)}
        assert sink.query("SELECT count() AS n FROM raw_acts").to_pydict()["n"] == [8]


@pytest.mark.parametrize("bad", [-1, 20, 2.5, True, "10"])
def test_a_bad_nice_is_refused_before_any_process_starts(tmp_path, bad):
    with pytest.raises(ConfigError, match=r"nice must be an int from 0 to 19, got"):
        WriterProcessSink.embedded(SCHEMA, tmp_path / "data", raw=["acts"], nice=bad)
    assert not (tmp_path / "data").exists() or not any((tmp_path / "data").iterdir())


def test_a_writer_that_stops_answering_is_killed_at_the_shutdown_grace(tmp_path):
    """A writer process that never answers (SIGSTOP: hung in an insert, say)
    held close for ever; now close cuts it off at the grace: the writer is
    killed, not left behind in its own session, the loop thread ends, and the
    other destination got every record."""
    from taproute.routing import Route, RoutingConfig, ShutdownAbandoned
    from taproute.service import RoutingSink
    from tests.sinks import NullSink

    sink = WriterProcessSink.embedded(SCHEMA, tmp_path / "data", raw=["acts"])
    pid = sink.writer_pid
    assert pid is not None
    ok = NullSink()
    routing = RoutingSink(
        RoutingConfig([Route("to_ch", "h.*", "ch"), Route("to_ok", "h.*", "ok")]),
        SCHEMA,
        {"ch": lambda: sink, "ok": ok},  # a factory: the routing sink owns (closes) it
        unmatched="drop",
    )
    runtime = create_record_runtime(record_sink=routing, name="taproute-writer-grace")
    stopped = False
    try:
        hook = runtime.bind_hook("h.0", layout="acts")
        _submit(runtime, sink, hook, 1, shared=False)
        runtime.flush()
        os.kill(pid, signal.SIGSTOP)
        stopped = True
        for step in range(2, 5):
            _submit(runtime, sink, hook, step, shared=False)
        with pytest.raises(ShutdownAbandoned) as caught:
            runtime.close(timeout=1.0)
        assert caught.value.busy == {"ch": "flush"} and caught.value.loop_ended
        assert _exited(pid, timeout=10), "the hung writer was left behind"
        stopped = False
        assert sink.writer_pid is None
        assert not [t for t in threading.enumerate() if t.name == "taproute-writer-grace"]
        assert ok.records == 16
        # The 12 records sent after the writer hung were lost with it: counted
        # (they were "nothing queued" before), never silently.
        assert caught.value.abandoned_records == {"ch": 12}
        destination = runtime.counters().destinations["ch"]
        assert destination.records == 16 and destination.given_up_records == 12
        assert sink.given_up_records() == sink.counters.abandoned_rows == 12
        assert sink.query("SELECT count() AS n FROM raw_acts").to_pylist() == [{"n": 4}]
    finally:
        if stopped:
            os.kill(pid, signal.SIGKILL)


def test_an_owned_writer_is_stopped_when_another_destination_fails_to_open(tmp_path):
    """The routing sink creates every owned destination before it starts
    any: a writer process created for a destination whose run never started
    (a later destination's factory raised) must not outlive the failure."""
    from taproute.actors import RoutingSink
    from taproute.routing import Route, RoutingConfig

    made: list[WriterProcessSink] = []
    pids: list[int | None] = []

    def writer() -> WriterProcessSink:
        made.append(WriterProcessSink.embedded(SCHEMA, tmp_path / "db", raw=["acts"]))
        pids.append(made[-1].writer_pid)
        return made[-1]

    def refuses() -> WriterProcessSink:
        raise ConfigError("this destination cannot be built")

    sink = RoutingSink(
        RoutingConfig([Route("to_w", "h.*", "w"), Route("to_bad", "h.*", "bad")]),
        SCHEMA,
        {"w": writer, "bad": refuses},
        unmatched="drop",
    )
    with pytest.raises(ConfigError, match="cannot be built"):
        trio.run(sink.run)
    (w,) = made
    assert pids[0] is not None and w.writer_pid is None, "the writer process was left running"
    assert _exited(pids[0], 10)
