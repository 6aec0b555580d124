"""The threaded runtime: producers on plain threads, the loop in its own thread."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import trio

from taproute.actors import RoutingSink
from taproute.native import make_descriptors
from taproute.routing import (
    IngressFull,
    PayloadSizeMismatch,
    Route,
    RoutingConfig,
    RoutingFailure,
    SinkClosed,
    UnboundOutputId,
)
from taproute.service import CaptureSink, RecordRuntime, create_record_runtime
from tests.processors import SCHEMA
from tests.sinks import FailingSink, NullSink

Q = "layers.0.attn.q"


class ThreadGateSink(CaptureSink):
    """A slow destination whose gate a plain thread opens."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.entered = threading.Event()

    async def submit(self, batch) -> None:
        self.entered.set()
        await trio.to_thread.run_sync(self.gate.wait)
        await super().submit(batch)


def eventually(predicate, timeout: float = 60.0) -> None:
    """Wait until ``predicate()`` holds (another thread makes it so), or fail."""
    deadline = time.monotonic() + timeout
    wake = threading.Event()
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        wake.wait(0.001)


def routing_sink(destinations, routes=None, **kwargs) -> RoutingSink:
    routes = routes if routes is not None else [Route("raw", "layers.*", "cap")]
    kwargs.setdefault("default_destination", "cap")
    return RoutingSink(RoutingConfig(routes), SCHEMA, destinations, **kwargs)


def vec_payload(n: int, start: float = 0.0) -> np.ndarray:
    return (np.arange(n * 4, dtype=np.float32) + start).reshape(n, 4)


def _own_threads() -> set[threading.Thread]:
    """Live threads, but Trio's cached worker threads ("Trio thread N"): those
    exit on their own 10 s after their last job, whichever test gave it, so
    one from an earlier test may end in the middle of this one."""
    return {t for t in threading.enumerate() if not t.name.startswith("Trio thread ")}


def test_submit_batch_shares_memory_and_releases_once():
    threads_before = _own_threads()
    sink = NullSink()
    released = threading.Event()
    calls = []
    payload = vec_payload(64)
    with create_record_runtime(record_sink=routing_sink({"cap": sink})) as runtime:
        q = runtime.bind_hook(Q, layout="vec")
        desc = make_descriptors(q, 16, count=64, layout_ids=SCHEMA.layout_id("vec"))
        runtime.submit_batch(desc, payload, release=lambda: (calls.append(1), released.set()))
        runtime.flush(timeout=60)
        assert released.wait(60)
        counters = runtime.counters()
    assert calls == [1]
    assert np.shares_memory(sink.seen_payloads[0], payload)
    assert counters.ingress.submitted == 64 and counters.ingress.batches == 1
    assert counters.destinations["cap"].records == 64
    assert _own_threads() == threads_before  # nothing left behind


def test_single_submits_are_coalesced_into_batches():
    cap = CaptureSink()
    with create_record_runtime(record_sink=routing_sink({"cap": cap})) as runtime:
        q = runtime.bind_hook(Q, layout="vec")
        for i in range(1000):
            runtime.submit(q, np.full(4, i, dtype=np.float32), key=i % 3, step=7)
        runtime.flush(timeout=60)
    desc = cap.descriptors()
    assert len(desc) == 1000
    assert len(cap.record_batches) < 1000  # coalesced, never one message per record
    assert desc["seq"].tolist() == list(range(1000))
    assert desc["key"].tolist() == [i % 3 for i in range(1000)]
    assert (desc["step"] == 7).all()
    values = np.concatenate(
        [b.payload.view(np.float32).reshape(-1, 4)[:, 0] for b in cap.record_batches]
    )
    assert values.tolist() == list(range(1000))


def test_bad_batches_are_refused_and_nothing_accepted_is_lost():
    cap = CaptureSink()
    with create_record_runtime(record_sink=routing_sink({"cap": cap})) as runtime:
        q = runtime.bind_hook(Q, layout="vec")
        runtime.submit_batch(make_descriptors(q, 16, count=2, layout_ids=0), vec_payload(2))
        with pytest.raises(UnboundOutputId, match="record 1 of the batch: output_id 9 was never"):
            runtime.submit_batch(make_descriptors([q, 9], 16, layout_ids=0), vec_payload(2))
        with pytest.raises(PayloadSizeMismatch, match="record 0 \\(hook 'layers.0.attn.q'\\)"):
            runtime.submit_batch(make_descriptors(q, 12, count=1, layout_ids=0), b"\0" * 12)
        with pytest.raises(PayloadSizeMismatch, match="outside the 16-byte buffer"):
            runtime.submit_batch(make_descriptors(q, 16, count=2, layout_ids=0), vec_payload(1))
        with pytest.raises(
            PayloadSizeMismatch, match="payload of 8 bytes does not fit layout 'vec'"
        ):
            runtime.submit(q, b"\0" * 8)
        with pytest.raises(UnboundOutputId, match="output_id 5 was never bound"):
            runtime.submit(5, b"\0" * 16)
        # The hook's name for its id: named as such (it was a bare TypeError on '<=').
        with pytest.raises(UnboundOutputId, match=r"output_id 'layers.0.attn.q' .* not the hook's"):
            runtime.submit(Q, b"\0" * 16)  # type: ignore[arg-type]
        runtime.submit(q, vec_payload(1, start=100.0))
        runtime.flush(timeout=60)
        assert runtime.failure is None
    assert cap.records == 3
    with pytest.raises(SinkClosed):
        runtime.submit(q, vec_payload(1))
    with pytest.raises(SinkClosed):
        runtime.submit_batch(make_descriptors(q, 16, count=1, layout_ids=0), vec_payload(1))


def test_variable_length_payloads_are_checked_against_the_tail():
    cap = CaptureSink()
    with create_record_runtime(record_sink=routing_sink({"cap": cap})) as runtime:
        t = runtime.bind_hook("layers.0.tokens", layout="tokens")
        runtime.submit(t, np.array([3], np.uint32).tobytes() + vec_payload(2).tobytes())
        with pytest.raises(PayloadSizeMismatch, match="4 bytes \\+ a multiple of 4|does not fit"):
            runtime.submit(t, b"\0" * 6)
        runtime.flush(timeout=60)
    assert cap.descriptors()["length"].tolist() == [36]


def test_full_ingress_blocks_the_producer_until_the_destination_moves():
    slow = ThreadGateSink()
    runtime = create_record_runtime(
        record_sink=routing_sink({"cap": slow}, destination_capacity=16),
        capacity_records=32,
    )
    q = runtime.bind_hook(Q, layout="vec")
    progress = []
    finished = threading.Event()

    def producer() -> None:
        for i in range(20):
            runtime.submit_batch(
                make_descriptors(q, 16, count=16, layout_ids=0, seqs=np.arange(16) + 16 * i),
                vec_payload(16),
            )
            progress.append(i)
        finished.set()

    thread = threading.Thread(target=producer)
    thread.start()
    assert slow.entered.wait(60)
    # The destination is shut: the producer ends up blocked in submit.
    # (Stable only once ingress is full: earlier, the loop may still be catching up.)
    eventually(
        lambda: (
            runtime.counters().ingress.blocked_producers == 1
            and runtime.counters().ingress.queued == 32
        )
    )
    assert not finished.is_set()
    assert len(progress) < 20
    counters = runtime.counters()
    assert counters.ingress.queued > 0
    slow.gate.set()
    assert finished.wait(60)
    thread.join()
    runtime.flush(timeout=60)
    counters = runtime.counters()
    runtime.close(timeout=60)
    assert counters.ingress.blocked_seconds > 0
    assert counters.ingress.rejected == 0
    assert slow.descriptors()["seq"].tolist() == list(range(320))


def test_reject_policy_raises_instead_of_blocking():
    slow = ThreadGateSink()
    runtime = create_record_runtime(
        record_sink=routing_sink({"cap": slow}, destination_capacity=16),
        capacity_records=32,
        when_full="reject",
    )
    q = runtime.bind_hook(Q, layout="vec")
    accepted = 0
    with pytest.raises(IngressFull, match="ingress full .*16 record\\(s\\) refused"):
        for _ in range(100):
            runtime.submit_batch(make_descriptors(q, 16, count=16, layout_ids=0), vec_payload(16))
            accepted += 1
    assert runtime.counters().ingress.rejected == 16
    slow.gate.set()
    runtime.close(timeout=60)
    assert slow.records == 16 * accepted  # every accepted record arrived


def test_failure_surfaces_in_flush_submit_and_close():
    failing = FailingSink(fail_on=1, message="insert refused")
    runtime = create_record_runtime(record_sink=routing_sink({"cap": failing}))
    q = runtime.bind_hook(Q, layout="vec")
    runtime.submit(q, vec_payload(1))
    with pytest.raises(RoutingFailure, match="destination 'cap', submit failed: OSError: insert"):
        runtime.flush(timeout=60)
    with pytest.raises(RoutingFailure, match="insert refused"):
        runtime.submit(q, vec_payload(1))
    with pytest.raises(RoutingFailure, match="insert refused"):
        runtime.close(timeout=60)
    assert "insert refused" in runtime.counters().failure


def test_an_exception_inside_with_stands_and_carries_the_latched_failure_as_a_note():
    """Leaving ``with`` by an exception: that exception propagates (not the
    runtime's), and the failure close() raised is attached as a note."""
    failing = FailingSink(fail_on=1, message="insert refused")
    runtime = create_record_runtime(record_sink=routing_sink({"cap": failing}))
    with pytest.raises(KeyError) as raised, runtime:
        q = runtime.bind_hook(Q, layout="vec")
        runtime.submit(q, vec_payload(1))
        with pytest.raises(RoutingFailure):
            runtime.flush(timeout=60)
        raise KeyError("the caller's own error")
    (note,) = raised.value.__notes__
    assert "failed too: RoutingFailure" in note
    assert "insert refused" in note


def test_submits_from_many_threads_all_arrive():
    sink = NullSink()
    with create_record_runtime(record_sink=routing_sink({"cap": sink})) as runtime:
        q = runtime.bind_hook(Q, layout="vec")

        def producer() -> None:
            for _ in range(500):
                runtime.submit(q, vec_payload(1))

        threads = [threading.Thread(target=producer) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        runtime.flush(timeout=60)
    assert sink.records == 2000


def test_a_plain_sink_can_be_the_record_sink():
    cap = CaptureSink()
    with create_record_runtime(record_sink=cap, schema=SCHEMA) as runtime:
        q = runtime.bind_hook(Q, layout="vec")
        runtime.submit(q, vec_payload(1))
        runtime.flush(timeout=60)
    assert cap.records == 1 and cap.closed


def test_asyncio_submit_waits_off_the_event_loop_when_ingress_is_full():
    import asyncio

    slow = ThreadGateSink()
    runtime = create_record_runtime(
        record_sink=routing_sink({"cap": slow}, destination_capacity=16), capacity_records=32
    )
    q = runtime.bind_hook(Q, layout="vec")

    async def main() -> int:
        ticks = 0
        stop = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0)

        ticking = asyncio.create_task(ticker())
        submits = []
        for i in range(8):  # far more than ingress + mailbox hold while the gate is shut
            descriptors = make_descriptors(
                q, 16, count=16, layout_ids=0, seqs=np.arange(16) + 16 * i
            )
            submits.append(asyncio.create_task(runtime.asubmit_batch(descriptors, vec_payload(16))))
        # Some submits are parked waiting for room; the loop still runs other tasks.
        while runtime.counters().ingress.blocked_producers == 0:
            await asyncio.sleep(0)
        before = ticks
        while ticks < before + 100:
            await asyncio.sleep(0)
        assert not all(s.done() for s in submits)
        slow.gate.set()
        await asyncio.gather(*submits)
        stop.set()
        await ticking
        return ticks

    assert asyncio.run(main()) > 100
    runtime.close(timeout=60)
    # Concurrent submitters are ordered by who got room first, like threads.
    assert sorted(slow.descriptors()["seq"].tolist()) == list(range(128))


def test_the_schema_owns_the_single_record_size_rule():
    vec = SCHEMA.size_rule(SCHEMA.layout_id("vec"))
    assert (vec.fixed, vec.prefix, vec.element) == (16, 0, 0)
    assert vec.fits(16) and not vec.fits(15)
    tokens = SCHEMA.size_rule(SCHEMA.layout_id("tokens"))
    assert (tokens.fixed, tokens.prefix, tokens.element) == (0, 4, 4)
    assert tokens.fits(4) and tokens.fits(12) and not tokens.fits(6) and not tokens.fits(2)
    with pytest.raises(PayloadSizeMismatch, match="hook 'h': payload of 6 bytes .* 'tokens'"):
        tokens.check(6, hook="h")


def test_the_runtime_alone_hosts_loop_tasks_and_cancels_them_at_close():
    cap = CaptureSink()
    runtime = RecordRuntime(cap, schema=SCHEMA)
    seen: list[str] = []

    async def companion(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
        seen.append("started")
        task_status.started()
        try:
            await trio.sleep_forever()
        finally:
            seen.append("cancelled")

    runtime.host(companion)
    with runtime.start():
        assert seen == ["started"]  # started before the runtime reports running
        with pytest.raises(RuntimeError, match="before the runtime starts"):
            runtime.host(companion)
        q = runtime.bind_hook(Q, layout="vec")
        runtime.submit(q, vec_payload(1))
        runtime.flush(timeout=60)
    assert seen == ["started", "cancelled"] and cap.records == 1 and cap.closed


def test_try_submit_batch_refuses_instead_of_waiting_when_ingress_is_full():
    slow = ThreadGateSink()
    runtime = create_record_runtime(
        record_sink=routing_sink({"cap": slow}, destination_capacity=16), capacity_records=32
    )
    q = runtime.bind_hook(Q, layout="vec")
    accepted = 0
    while runtime.try_submit_batch(
        make_descriptors(q, 16, count=16, layout_ids=0), vec_payload(16)
    ):
        accepted += 1
        assert accepted < 100, "ingress never filled"
    assert runtime.counters().ingress.rejected == 0  # refused, not counted as rejected
    slow.gate.set()
    runtime.close(timeout=60)
    assert slow.records == 16 * accepted


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("key", 2**70),
        ("step", -(2**63) - 1),
        ("seq", 2**64),
        ("timestamp_ns", 2**63),
        ("key", 1.5),
        ("step", True),
    ],
)
def test_a_bad_submit_field_is_refused_at_the_call_and_loses_nothing(field, value):
    from taproute.native import DescriptorFieldError

    cap = CaptureSink()
    with create_record_runtime(record_sink=routing_sink({"cap": cap})) as runtime:
        q = runtime.bind_hook(Q, layout="vec")
        for i in range(5):
            runtime.submit(q, np.full(4, i, np.float32), key=i)
        with pytest.raises(DescriptorFieldError, match=field) as refused:
            runtime.submit(q, np.full(4, 99, np.float32), **{field: value})
        assert "range" in str(refused.value) or "integer" in str(refused.value)
        for i in range(5, 10):
            runtime.submit(q, np.full(4, i, np.float32), key=i)
        runtime.flush()  # the loop is alive and nothing coalesced beside the bad call was lost
        assert sorted(int(k) for b in cap.batches for k in b.descriptors["key"]) == list(range(10))
    cap.clear()


def test_make_descriptors_names_the_field_that_does_not_fit():
    from taproute.native import DescriptorFieldError

    with pytest.raises(DescriptorFieldError, match=r"key=1180591620717411303424 is outside"):
        make_descriptors(0, 4, keys=[1, 2**70])
    with pytest.raises(DescriptorFieldError, match="key=18446744073709551615"):
        make_descriptors(0, 4, keys=np.array([1, 2**64 - 1], np.uint64))
    with pytest.raises(DescriptorFieldError, match="float64"):
        make_descriptors(0, 4, steps=np.array([0.5]))
    # Narrower integer arrays are taken as they are.
    assert list(make_descriptors(0, 4, keys=np.arange(3, dtype=np.uint32))["key"]) == [0, 1, 2]


def test_a_control_queued_while_the_dead_loop_is_being_wound_up_fails_with_its_error():
    # The window: trio.run has ended (a loop task failed) but the loop thread
    # has not yet emptied ingress. A close in that window used to raise Trio's
    # RunFinishedError from run_sync_soon; it must fail with the loop's error.
    runtime = RecordRuntime(CaptureSink(), schema=SCHEMA)
    boom = threading.Event()
    wound_up, proceed = threading.Event(), threading.Event()

    async def doomed(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await trio.to_thread.run_sync(boom.wait, 60)
        raise OSError("the loop task failed")

    runtime.host(doomed)
    real_fail = runtime._ingress.fail

    def held_fail(error, *, loop_gone=False):
        if loop_gone:
            wound_up.set()
            assert proceed.wait(60)
        return real_fail(error, loop_gone=loop_gone)

    runtime._ingress.fail = held_fail  # type: ignore[method-assign]
    runtime.start()
    boom.set()
    assert wound_up.wait(60)
    future = runtime._ingress.put_control("close")  # raised RunFinishedError before
    proceed.set()
    with pytest.raises(RoutingFailure, match="runtime loop failed: OSError: the loop task failed"):
        future.result(60)
    with pytest.raises(RoutingFailure, match="runtime loop failed: OSError: the loop task failed"):
        runtime.close(timeout=60)


def test_bind_hook_after_close_is_refused_naming_what_is_closed():
    """It used to succeed silently: a hook bound to a closed runtime can never
    submit.  The refusal names what is closed and binds nothing."""
    sink = routing_sink({"cap": NullSink()})
    runtime = create_record_runtime(record_sink=sink)
    q = runtime.bind_hook(Q, layout="vec")
    runtime.close(timeout=60)
    with pytest.raises(SinkClosed, match=r"^runtime is closed; bind_hook\('layers.1.q'\) refused"):
        runtime.bind_hook("layers.1.q", layout="vec")
    with pytest.raises(SinkClosed, match=r"^routing sink is closed; bind_hook\('layers.1.q'\)"):
        sink.bind_hook("layers.1.q", layout="vec")
    assert runtime.hooks.id_of("layers.1.q") is None and runtime.hooks.id_of(Q) == q
    with pytest.raises(SinkClosed, match="runtime is closed"):  # as submit after close
        runtime.submit(q, vec_payload(1))


def test_an_empty_batch_is_a_no_op_that_still_releases_its_buffer():
    """An empty ``submit_batch`` is accepted (its release runs once, like any
    batch's) but counts as no ingress batch and reaches no sink: ``batches``
    counts batches of records (it counted every empty one)."""
    sink = NullSink()
    released = threading.Event()
    vec = SCHEMA.layout_id("vec")
    with create_record_runtime(record_sink=routing_sink({"cap": sink})) as runtime:
        q = runtime.bind_hook(Q, layout="vec")
        empty = make_descriptors(q, 16, count=0, layout_ids=vec)
        runtime.submit_batch(empty, np.zeros((0, 4), np.float32), release=released.set)
        assert runtime.try_submit_batch(empty, np.zeros((0, 4), np.float32))
        assert runtime.offer_batch(empty, np.zeros((0, 4), np.float32))
        runtime.submit_batch(make_descriptors(q, 16, count=2, layout_ids=vec), vec_payload(2))
        runtime.flush(timeout=60)
        assert released.wait(60)
        counters = runtime.counters()
    assert counters.ingress.batches == 1 and counters.ingress.submitted == 2
    assert counters.destinations["cap"].records == 2
    # A plain sink hosted by the runtime is never handed the empty batch.
    plain = CaptureSink()
    with create_record_runtime(record_sink=plain) as runtime:
        q = runtime.bind_hook(Q, layout="vec")
        runtime.submit_batch(make_descriptors(q, 16, count=0), np.zeros(0, np.uint8))
        runtime.flush(timeout=60)
        assert plain.batches == [] and runtime.counters().ingress.batches == 0
    with pytest.raises(SinkClosed, match="runtime is closed; submit refused"):
        runtime.submit_batch(make_descriptors(q, 16, count=0), np.zeros(0, np.uint8))
