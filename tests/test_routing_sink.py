"""RoutingSink semantics, in a Trio program (open_routing_sink, no thread)."""

from __future__ import annotations

import numpy as np
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from taproute.actors import open_routing_sink
from taproute.routing import (
    FailureCode,
    FailurePolicy,
    HookRegistry,
    KeyOutOfRange,
    OutputLayoutMismatch,
    RecordFailure,
    Route,
    RoutingConfig,
    RoutingFailure,
    SinkClosed,
)
from taproute.service import CaptureSink
from tests import processors
from tests.conftest import vec_batch
from tests.processors import NORM, SCHEMA, Rendezvous
from tests.sinks import FailingSink, GatedFailingSink, GateSink, NullSink

Q = "layers.0.attn.q"
K = "layers.0.attn.k"


def hooks_with(*names: str) -> tuple[HookRegistry, list[int]]:
    hooks = HookRegistry()
    return hooks, [hooks.bind(n, layout="vec") for n in names]


async def test_raw_only_route_forwards_the_same_object_without_copy(release_log):
    hooks, (q,) = hooks_with(Q)
    cap = CaptureSink()
    config = RoutingConfig([Route("raw", "layers.*.attn.q", "cap")])
    batch = vec_batch(q, 8, release=release_log.callback("b"))
    producer_memory = batch.payload
    async with open_routing_sink(config, SCHEMA, {"cap": cap}, "cap", hooks=hooks) as sink:
        await sink.submit(batch)
        await sink.flush()
        assert cap.batches == [batch]
        assert cap.batches[0] is batch
        assert np.shares_memory(cap.batches[0].payload, producer_memory)
        assert not cap.batches[0].payload.flags.writeable
        counters = sink.counters()
    assert counters.routes["raw"].emitted == 8
    assert counters.destinations["cap"].records == 8
    assert counters.destinations["cap"].bytes == 8 * 16
    batch.lease.release()  # the submitter's own hold
    assert release_log.calls == {}  # the capture sink still holds the buffer
    cap.clear()
    assert release_log.calls == {"b": 1}


async def test_processed_only_route_emits_validated_rows():
    hooks, (q,) = hooks_with(Q)
    out = CaptureSink()
    config = RoutingConfig([Route("norms", Q, "out", mode="stateless", processor="test.norms")])
    async with open_routing_sink(
        config, SCHEMA, {"out": out}, unmatched="drop", hooks=hooks
    ) as sink:
        await sink.submit(vec_batch(q, 5))
        await sink.flush()
    rows = out.rows("norms")
    assert rows.dtype == NORM.dtype
    expected = np.linalg.norm(np.arange(5)[:, None] + np.arange(4), axis=1)
    np.testing.assert_allclose(rows["norm"], expected, rtol=1e-6)
    assert rows["seq"].tolist() == [0, 1, 2, 3, 4]
    assert out.record_batches == []  # nothing raw reached it


async def test_raw_plus_processed_fan_out_shares_one_batch(release_log):
    hooks, (q,) = hooks_with(Q)
    raw_a, raw_b, processed = NullSink(), NullSink(), CaptureSink()
    config = RoutingConfig(
        [
            Route("raw_a", Q, "a"),
            Route("raw_b", "layers.*", "b"),
            Route("norms", Q, "p", mode="stateless", processor="test.norms", workers=2),
            Route("sums", Q, "p", mode="stateful", processor="test.running_sum", workers=2),
        ]
    )
    batch = vec_batch(q, 32, keys=np.arange(32) % 5, release=release_log.callback("b"))
    async with open_routing_sink(
        config, SCHEMA, {"a": raw_a, "b": raw_b, "p": processed}, unmatched="drop", hooks=hooks
    ) as sink:
        await sink.submit(batch)
        batch.lease.release()
        await sink.flush()
        counters = sink.counters()
    # Both forward routes saw the very same payload memory, no copy.
    assert raw_a.seen_payloads[0] is batch.payload
    assert raw_b.seen_payloads[0] is batch.payload
    assert len(processed.rows("norms")) == 32
    sums = processed.rows("sums")
    assert len(sums) == 32
    last_for_key = {int(k): row for k, row in zip(sums["key"], sums, strict=True)}
    for key in range(5):
        members = np.arange(32)[np.arange(32) % 5 == key]
        assert last_for_key[key]["count"] == len(members)
        np.testing.assert_allclose(
            last_for_key[key]["total"], (members[:, None] + np.arange(4)).sum(axis=0)
        )
    assert counters.routes["sums"].valid_slots == 5
    assert counters.routes["norms"].processed == 32
    assert release_log.calls == {"b": 1}  # every holder done, exactly once


async def test_mixed_batch_is_grouped_by_route_and_unmatched_goes_to_default():
    hooks, (q, k, other) = hooks_with(Q, K, "mlp.0")
    qs, ks, default = CaptureSink(), CaptureSink(), CaptureSink()
    config = RoutingConfig([Route("q", "*.q", "qs"), Route("qk", ["*.q", "*.k"], "ks")])
    ids = np.array([q, k, other, q, other, k], dtype=np.uint32)
    async with open_routing_sink(
        config, SCHEMA, {"qs": qs, "ks": ks, "d": default}, "d", hooks=hooks
    ) as sink:
        await sink.submit(vec_batch(0, 6, output_ids=ids))
        await sink.flush()
        counters = sink.counters()
    assert qs.descriptors()["seq"].tolist() == [0, 3]
    assert ks.descriptors()["seq"].tolist() == [0, 1, 3, 5]
    assert default.descriptors()["seq"].tolist() == [2, 4]
    assert counters.unmatched_forwarded == 2


@pytest.mark.filterwarnings("ignore::taproute.routing.GlobMatchesNothing")
async def test_unmatched_records_are_dropped_and_counted_only_when_asked():
    hooks, (q,) = hooks_with(Q)
    cap = CaptureSink()
    config = RoutingConfig([Route("k", "*.k", "cap")])  # matches nothing bound: warns
    async with open_routing_sink(
        config, SCHEMA, {"cap": cap}, unmatched="drop", hooks=hooks
    ) as sink:
        await sink.submit(vec_batch(q, 7))
        await sink.flush()
        assert sink.counters().unmatched_dropped == 7
    assert cap.batches == []


async def test_late_bound_hook_matches_glob():
    hooks = HookRegistry()
    cap = CaptureSink()
    config = RoutingConfig([Route("q", "layers.*.attn.q", "cap")])
    async with open_routing_sink(
        config, SCHEMA, {"cap": cap}, unmatched="drop", hooks=hooks
    ) as sink:
        late = sink.bind_hook("layers.11.attn.q", layout="vec")
        await sink.submit(vec_batch(late, 3))
        await sink.flush()
    assert cap.records == 3


async def test_bad_output_is_a_route_failure_not_a_write():
    hooks, (q,) = hooks_with(Q)
    out = CaptureSink()
    failures: list[RecordFailure] = []
    config = RoutingConfig(
        [Route("bad", Q, "out", mode="stateless", processor="test.wrong_layout")]
    )
    async with open_routing_sink(
        config, SCHEMA, {"out": out}, "out", hooks=hooks, on_failure=failures.append
    ) as sink:
        await sink.submit(vec_batch(q, 4))
        await sink.flush()
        counters = sink.counters()
    assert out.batches == []
    assert counters.routes["bad"].failed == 4
    assert counters.routes["bad"].processed == 0
    assert counters.routes["bad"].failures_by_code == {"handler_invalid": 8}  # batch, then each
    assert sink.failure is None  # per-record failures are not latched
    # Not retried; isolated record by record, each given up on its own.
    assert [len(f.records) for f in failures] == [1, 1, 1, 1]
    failure = failures[0]
    assert failure.code is FailureCode.HANDLER_INVALID and failure.attempts == 1
    assert isinstance(failure.error, OutputLayoutMismatch)
    assert str(failure.error) == (
        "route 'bad', processor 'test.wrong_layout', output layout 'norm': column 'norm' "
        "expected Float32 (float32), found float64"
    )


async def test_processor_exception_is_counted_and_router_keeps_going():
    hooks, (q, k) = hooks_with(Q, K)
    out = CaptureSink()
    failures: list[RecordFailure] = []
    config = RoutingConfig(
        [
            Route("boom", Q, "out", mode="stateless", processor="test.raises"),
            Route("ok", K, "out", mode="stateless", processor="test.norms"),
        ]
    )
    async with open_routing_sink(
        config, SCHEMA, {"out": out}, "out", hooks=hooks, on_failure=failures.append
    ) as sink:
        await sink.submit(vec_batch(q, 2))
        await sink.submit(vec_batch(k, 3))
        await sink.flush()
        counters = sink.counters()
    assert counters.routes["boom"].failed == 2
    assert len(out.rows("ok")) == 3
    assert [f.code for f in failures] == [FailureCode.HANDLER_PANIC] * 2
    assert failures[0].message == (
        "route 'boom', processor 'test.raises': 1 record(s) given up after 1 attempt(s) "
        "[handler_panic]: ValueError: malformed input"
    )
    assert 'raise ValueError("malformed input")' in failures[0].traceback


async def test_key_outside_range_fails_those_records_only():
    hooks, (q,) = hooks_with(Q)
    out = CaptureSink()
    failures: list[RecordFailure] = []
    config = RoutingConfig(
        [Route("order", Q, "out", mode="stateful", processor="test.order_log", workers=2)]
    )
    processors.ORDER_LOG.clear()
    async with open_routing_sink(
        config, SCHEMA, {"out": out}, "out", hooks=hooks, on_failure=failures.append
    ) as sink:
        await sink.submit(vec_batch(q, 4, keys=[1, 99, 2, -1]))
        await sink.flush()
        counters = sink.counters()
    (failure,) = failures
    assert failure.code is FailureCode.POLICY_INVALID
    assert isinstance(failure.error, KeyOutOfRange)
    assert "key 99 of record 1 is outside [0, 16); 2 record(s)" in str(failure.error)
    assert failure.records.descriptors["seq"].tolist() == [1, 3]
    assert processors.ORDER_LOG == {1: [0], 2: [2]}
    assert counters.routes["order"].failed == 2
    assert counters.routes["order"].valid_slots == 2


async def test_stateless_workers_run_concurrently():
    hooks, (q,) = hooks_with(Q)
    out = CaptureSink()
    workers = 3
    processors.RENDEZVOUS["current"] = rendezvous = Rendezvous(workers)
    # Each call waits at the barrier for the others: under the default 5 s
    # deadline a loaded machine that starts the third thread late fails the
    # first two (their deadline is not what this test is about).
    config = RoutingConfig(
        [
            Route(
                "pool",
                Q,
                "out",
                mode="stateless",
                processor="test.rendezvous",
                workers=workers,
                failure_policy=FailurePolicy(deadline=60),
            )
        ]
    )
    failures: list[RecordFailure] = []
    async with open_routing_sink(
        config, SCHEMA, {"out": out}, "out", hooks=hooks, on_failure=failures.append
    ) as sink:
        for i in range(workers):
            await sink.submit(vec_batch(q, 2, seq_start=10 * i))
        await sink.flush()
    # The barrier only opens when all three calls are in flight at once.
    assert failures == []
    assert rendezvous.max_in_flight == workers
    assert len(out.rows("pool")) == 2 * workers


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    keys=st.lists(st.integers(0, processors.KEY_RANGE - 1), min_size=1, max_size=120),
    cuts=st.lists(st.integers(1, 30), max_size=10),
    owners=st.integers(1, 4),
)
def test_same_key_records_are_processed_in_arrival_order(keys, cuts, owners):
    processors.ORDER_LOG.clear()
    hooks, (q,) = hooks_with(Q)

    async def main() -> None:
        config = RoutingConfig(
            [
                Route(
                    "order",
                    Q,
                    "out",
                    mode="stateful",
                    processor="test.order_log",
                    workers=owners,
                    capacity=8,
                )
            ]
        )
        async with open_routing_sink(
            config, SCHEMA, {"out": NullSink()}, "out", hooks=hooks
        ) as sink:
            start = 0
            for cut in [*cuts, len(keys)]:
                part = keys[start : start + cut]
                if part:
                    await sink.submit(vec_batch(q, len(part), keys=part, seq_start=start))
                start += cut
                if start >= len(keys):
                    break
            await sink.flush()

    trio.run(main)
    expected: dict[int, list[int]] = {}
    for seq, key in enumerate(keys):
        expected.setdefault(key, []).append(seq)
    assert expected == processors.ORDER_LOG


async def test_full_destination_blocks_the_record_worker_and_drops_nothing(autojump_clock):
    hooks, (q,) = hooks_with(Q)
    slow = GateSink()
    config = RoutingConfig([Route("raw", Q, "slow")])
    done_submitting = trio.Event()
    submitted = 0
    async with open_routing_sink(
        config, SCHEMA, {"slow": slow}, "slow", hooks=hooks, destination_capacity=20
    ) as sink:

        async def producer() -> None:
            nonlocal submitted
            for i in range(10):
                await sink.submit(vec_batch(q, 10, seq_start=10 * i))
                submitted += 1
            done_submitting.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(producer)
            await trio.testing.wait_all_tasks_blocked()
            # One batch is inside the sink, two fit in the mailbox (20 records), the
            # producer is stuck on the fourth.
            assert slow.entered == 1
            assert submitted == 3
            assert not done_submitting.is_set()
            blocked = sink.counters()
            assert blocked.destinations["slow"].queue_depth == 20
            slow.gate.set()
            await done_submitting.wait()
        await sink.flush()
        drained = sink.counters()
    assert drained.destinations["slow"].queue_depth == 0
    assert drained.destinations["slow"].records == 100
    assert slow.descriptors()["seq"].tolist() == list(range(100))


async def test_full_route_mailbox_counts_backlog_then_drains(autojump_clock):
    hooks, (q,) = hooks_with(Q)
    slow = GateSink()
    # No deadline: the autojump clock would otherwise jump past it while a
    # processor thread runs.
    config = RoutingConfig(
        [
            Route(
                "norms",
                Q,
                "slow",
                mode="stateless",
                processor="test.norms",
                capacity=10,
                failure_policy=FailurePolicy(deadline=0),
            )
        ]
    )
    async with (
        open_routing_sink(
            config, SCHEMA, {"slow": slow}, "slow", hooks=hooks, destination_capacity=10
        ) as sink,
        trio.open_nursery() as nursery,
    ):

        async def producer() -> None:
            for i in range(6):
                await sink.submit(vec_batch(q, 10, seq_start=10 * i))

        nursery.start_soon(producer)
        # Wait until the route's mailbox is full and the record worker is parked.
        while sink.counters().routes["norms"].queue_depth < 10:
            await trio.sleep(0.01)
        await trio.testing.wait_all_tasks_blocked()
        route = sink.counters().routes["norms"]
        assert route.backlog > route.queue_depth == 10
        slow.gate.set()
    async with open_routing_sink(config, SCHEMA, {"slow": slow}, "slow", hooks=hooks):
        pass
    assert len(slow.rows("norms")) == 60
    assert slow.rows("norms")["seq"].tolist() == list(range(60))


async def test_flush_waits_for_everything_submitted_before(autojump_clock):
    hooks, (q,) = hooks_with(Q)
    slow = GateSink()
    config = RoutingConfig([Route("raw", Q, "slow")])
    async with open_routing_sink(config, SCHEMA, {"slow": slow}, "slow", hooks=hooks) as sink:
        await sink.submit(vec_batch(q, 4))
        flushed = trio.Event()

        async def flusher() -> None:
            await sink.flush()
            flushed.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(flusher)
            await trio.testing.wait_all_tasks_blocked()
            assert not flushed.is_set()
            assert slow.flushes == 0
            slow.gate.set()
        assert slow.records == 4 and slow.flushes == 1


async def test_first_failure_is_latched_and_later_ones_do_not_replace_it():
    hooks, (q, k) = hooks_with(Q, K)
    first = FailingSink(fail_on=2, message="first: disk full")
    second = FailingSink(fail_on=1, message="second: network down")
    config = RoutingConfig([Route("to_first", Q, "first"), Route("to_second", K, "second")])
    with pytest.raises(RoutingFailure) as caught:
        async with open_routing_sink(
            config, SCHEMA, {"first": first, "second": second}, unmatched="drop", hooks=hooks
        ) as sink:
            await sink.submit(vec_batch(q, 2))
            await sink.flush()
            await sink.submit(vec_batch(q, 2, seq_start=2))
            with pytest.raises(RoutingFailure) as at_flush:
                await sink.flush()
            failure = at_flush.value
            assert failure.route == "to_first" and failure.destination == "first"
            assert "route 'to_first', destination 'first', submit failed: OSError: first" in str(
                failure
            )
            assert isinstance(failure.__cause__, OSError)
            with pytest.raises(RoutingFailure) as at_submit:
                await sink.submit(vec_batch(k, 1))
            assert at_submit.value is failure
            assert sink.counters().destinations["first"].errors == 1
    assert caught.value is failure  # close raised the same, first failure
    assert first.records == 2  # what went in before the failure stayed


async def test_later_failure_elsewhere_does_not_replace_the_first():
    hooks, (q, k) = hooks_with(Q, K)
    first = FailingSink(fail_on=1, message="first")
    second = GatedFailingSink(message="second")
    config = RoutingConfig([Route("a", Q, "first"), Route("b", K, "second")])
    with pytest.raises(RoutingFailure, match="destination 'first'"):
        async with open_routing_sink(
            config, SCHEMA, {"first": first, "second": second}, unmatched="drop", hooks=hooks
        ) as sink:
            await sink.submit(vec_batch(0, 2, output_ids=np.array([q, k], dtype=np.uint32)))
            await trio.testing.wait_all_tasks_blocked()
            assert sink.failure is not None and sink.failure.destination == "first"
            second.gate.set()  # now the second destination fails too
            await trio.testing.wait_all_tasks_blocked()
            assert sink.counters().destinations["second"].errors == 1
            assert sink.failure.destination == "first"


async def test_close_closes_only_the_sinks_it_created_and_refuses_more():
    hooks, (q,) = hooks_with(Q)
    leased = NullSink()
    created: list[NullSink] = []

    def make() -> NullSink:
        created.append(NullSink())
        return created[-1]

    config = RoutingConfig([Route("a", Q, "leased"), Route("b", Q, "created")])
    async with open_routing_sink(
        config, SCHEMA, {"leased": leased, "created": make}, unmatched="drop", hooks=hooks
    ) as sink:
        await sink.submit(vec_batch(q, 3))
    assert leased.records == 3 and created[0].records == 3
    assert leased.flushes == 1 and created[0].flushes == 1
    assert created[0].closed and not leased.closed
    with pytest.raises(SinkClosed):
        await sink.submit(vec_batch(q, 1))
    await sink.close()  # idempotent
