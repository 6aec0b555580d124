"""Route failures: codes from real processors, backoff and give-up, same-key hold,
dead letters across a restart, skip and reroute, trace, exact accounting."""

from __future__ import annotations

import random

import numpy as np
import pytest
import trio
import trio.testing

from taproute.actors import RoutingSink, open_routing_sink
from taproute.routing import (
    FailureCode,
    FailurePolicy,
    HookRegistry,
    RecordBatch,
    RecordFailure,
    Route,
    RoutingConfig,
    UnboundOutputId,
)
from taproute.service import CaptureSink, DeadLetterStore, create_record_runtime
from tests.conftest import one_route_sink, vec_batch
from tests.failing_processors import SCRIPT
from tests.processors import SCHEMA
from tests.sinks import NullSink

Q = "layers.0.q"
NO_DEADLINE = FailurePolicy(deadline=0)  # autojump would otherwise jump past a deadline


@pytest.fixture(autouse=True)
def fresh_script():
    SCRIPT.reset()
    yield
    SCRIPT.release_hang.set()


def hooks_with_q() -> tuple[HookRegistry, int]:
    hooks = HookRegistry()
    return hooks, hooks.bind(Q, layout="vec")


async def run_route(processor, batch_size=3, policy=None, **kw) -> tuple[list, CaptureSink, object]:
    hooks, q = hooks_with_q()
    out = CaptureSink()
    failures: list[RecordFailure] = []
    route = Route(
        "r",
        Q,
        "out",
        mode="stateless",
        processor=processor,
        failure_policy=policy or FailurePolicy(max_failures=1, failure_window=0, deadline=0),
        **kw,
    )
    async with one_route_sink(route, out, hooks=hooks, on_failure=failures.append) as sink:
        await sink.submit(vec_batch(q, batch_size))
        await sink.flush()
        counters = sink.counters()
    return failures, out, counters


@pytest.mark.parametrize(
    ("processor", "code", "error"),
    [
        ("fail.panics", FailureCode.HANDLER_PANIC, "ZeroDivisionError: division by zero"),
        ("fail.wrong_layout", FailureCode.HANDLER_INVALID, "OutputLayoutMismatch: route 'r'"),
        (
            "fail.always_transient",
            FailureCode.HANDLER_FAILED,
            "ProcessorFailed: feature store restarting",
        ),
    ],
)
async def test_each_code_comes_from_a_real_processor(processor, code, error, autojump_clock):
    failures, out, counters = await run_route(processor, batch_size=1)
    (failure,) = failures
    assert failure.code is code
    assert f"{type(failure.error).__name__}: {failure.error}".startswith(error)
    assert counters.routes["r"].failed == 1 and out.batches == []
    if code is FailureCode.HANDLER_PANIC:
        assert "in panics" in failure.traceback  # the processor frame is kept


async def test_invalid_input_is_not_retried():
    SCRIPT.broken = True
    failures, _, counters = await run_route(
        "fail.invalid_when_broken", batch_size=2, policy=FailurePolicy()
    )
    assert [f.code for f in failures] == [FailureCode.HANDLER_INVALID] * 2
    assert all(f.attempts == 1 for f in failures)
    assert counters.routes["r"].retries == 0


async def test_a_processor_that_never_returns_is_abandoned_at_the_deadline():
    policy = FailurePolicy(deadline=0.2, max_failures=1, failure_window=0)
    with trio.fail_after(60):  # a hang guard only
        failures, _, _ = await run_route("fail.hangs", batch_size=1, policy=policy)
    (failure,) = failures
    assert failure.code is FailureCode.HANDLER_TIMEOUT
    assert "0.2 s deadline" in str(failure.error)
    # The route was not held: its only worker slot is free again (a held slot
    # would block this call until the hang guard fires).  A deadline of its
    # own: a quick call's thread can take over 0.2 s to start on a loaded machine.
    quick = FailurePolicy(deadline=60, max_failures=1, failure_window=0)
    with trio.fail_after(120):
        failures2, _, _ = await run_route("fail.panics", batch_size=1, policy=quick)
    assert failures2[0].code is FailureCode.HANDLER_PANIC


async def test_backoff_schedule_and_give_up_rule(autojump_clock):
    hooks, q = hooks_with_q()
    given_up = trio.Event()
    failures: list[RecordFailure] = []

    def on_failure(failure: RecordFailure) -> None:
        failures.append(failure)
        given_up.set()

    policy = FailurePolicy(
        deadline=0, initial_backoff=2, max_backoff=50, max_failures=5, failure_window=100
    )
    route = Route(
        "r", Q, "out", mode="stateless", processor="fail.always_transient", failure_policy=policy
    )
    async with open_routing_sink(
        RoutingConfig([route]),
        SCHEMA,
        {"out": NullSink()},
        unmatched="drop",
        hooks=hooks,
        on_failure=on_failure,
    ) as sink:
        start = trio.current_time()
        await sink.submit(vec_batch(q, 1))
        await given_up.wait()
        counters = sink.counters()
    calls = [t - start for t in SCRIPT.calls]
    # Backoff 2, 4, 8, 16, 32, then capped at 50.  After 5 failures (t=30) the
    # 100 s window has not passed: still retried.  Given up at the first failure
    # past the window with at least 5 failures (t=112 + 0).
    assert calls == pytest.approx([0, 2, 6, 14, 30, 62, 112])
    (failure,) = failures
    assert failure.attempts == 7 and failure.code is FailureCode.HANDLER_FAILED
    assert counters.routes["r"].retries == 6 and counters.routes["r"].parked == 0


async def test_transient_failures_recover_without_loss(mock_clock):
    SCRIPT.failures_left[-1] = 2
    hooks, q = hooks_with_q()
    out = CaptureSink()
    failures: list[RecordFailure] = []
    route = Route(
        "r",
        Q,
        "out",
        mode="stateless",
        processor="fail.transient_then_ok",
        failure_policy=NO_DEADLINE,
    )
    async with one_route_sink(route, out, hooks=hooks, on_failure=failures.append) as sink:
        await sink.submit(vec_batch(q, 4))
        await sink.flush()  # flush does not wait for parked retries...
        assert sink.counters().routes["r"].parked == 4
        for backoff in (2, 4):  # ...they come back after 2 s, then 4 s
            mock_clock.jump(backoff)
            await trio.testing.wait_all_tasks_blocked()
            await sink.flush()
        counters = sink.counters().routes["r"]
    assert failures == []
    assert out.rows("r")["seq"].tolist() == [0, 1, 2, 3]
    assert counters.retries == 2 and counters.recovered == 4 and counters.parked == 0
    assert counters.failures_by_code == {"handler_failed": 8}


async def test_failing_key_holds_its_later_records_while_other_keys_flow(mock_clock):
    hooks, q = hooks_with_q()
    SCRIPT.failures_left[3] = 2
    route = Route(
        "keyed",
        Q,
        "out",
        mode="stateful",
        processor="fail.keyed_log",
        workers=2,
        failure_policy=NO_DEADLINE,
    )
    keys = [3, 1, 3, 2, 1, 3, 2]
    async with open_routing_sink(
        RoutingConfig([route]), SCHEMA, {"out": NullSink()}, unmatched="drop", hooks=hooks
    ) as sink:
        for seq, key in enumerate(keys):
            await sink.submit(vec_batch(q, 1, keys=[key], seq_start=seq))
        await sink.flush()
        before_retry = list(SCRIPT.log)
        held = sink.counters().routes["keyed"].parked
        for backoff in (2, 4):  # past both backoffs: key 3 recovers
            mock_clock.jump(backoff)
            await trio.testing.wait_all_tasks_blocked()
            await sink.flush()
        after = list(SCRIPT.log)
    # Other keys went through while key 3 was failing...
    assert [k for k, _ in before_retry] == [1, 2, 1, 2]
    assert held == 3  # ...and all three key-3 records waited, the failing one first.
    # Then key 3's records, in arrival order.
    assert [(k, s) for k, s in after if k == 3] == [(3, 0), (3, 2), (3, 5)]
    assert len(after) == 7


async def test_dead_letters_survive_a_restart_and_reroute_after_the_fix(tmp_path):
    path = tmp_path / "dead.sqlite"
    hooks = HookRegistry()
    store = DeadLetterStore(path, hooks=hooks)
    SCRIPT.broken = True
    config = RoutingConfig(
        [Route("r", "layers.*", "out", mode="stateless", processor="fail.invalid_when_broken")]
    )
    sink = RoutingSink(
        config,
        SCHEMA,
        {"out": CaptureSink()},
        unmatched="drop",
        hooks=hooks,
        on_failure=store.handle,
    )
    batch = vec_batch(0, 3, seq_start=100)
    with create_record_runtime(record_sink=sink, dead_letters=store) as runtime:
        q = runtime.bind_hook(Q, layout="vec")
        assert q == 0
        runtime.submit_batch(batch.descriptors, batch.payload)
        runtime.flush()
    store.close()

    # "Restart": a new process would open the same file.
    hooks2 = HookRegistry()
    reopened = DeadLetterStore(path, hooks=hooks2)
    letters = reopened.list()
    assert [(d.route, d.code, d.hook, d.seq, d.attempts) for d in letters] == [
        ("r", "handler_invalid", Q, 100 + i, 1) for i in range(3)
    ]
    assert letters[0].error == "InvalidInput: values out of range"
    full = reopened.get(letters[1].id)
    assert full.payload == batch.payload_of(1).tobytes()

    SCRIPT.broken = False  # the processor is fixed
    out = CaptureSink()
    sink2 = RoutingSink(
        config, SCHEMA, {"out": out}, unmatched="drop", hooks=hooks2, on_failure=reopened.handle
    )
    with create_record_runtime(record_sink=sink2, dead_letters=reopened) as runtime:
        skipped = reopened.skip(letters[0].id)
        assert skipped.state == "skipped"
        for letter in letters[1:]:
            assert runtime.reroute(letter.id).state == "rerouted"
        runtime.flush()
    assert out.rows("r")["seq"].tolist() == [101, 102]
    assert reopened.list() == []  # nothing left unhandled
    assert [d.state for d in reopened.list(state=None)] == ["skipped", "rerouted", "rerouted"]
    reopened.close()


async def test_trace_reports_verdicts_and_runs_no_processor():
    hooks, q = hooks_with_q()
    hooks.bind("layers.0.k", layout="vec")
    SCRIPT.broken = True  # a processor call would raise: trace must not make one
    config = RoutingConfig(
        [
            Route("raw", "layers.*", "cap"),
            Route(
                "even_steps",
                "layers.*.q",
                "cap",
                mode="stateless",
                processor="fail.invalid_when_broken",
                predicate=lambda d: (d["step"] % 2 == 0, "odd step\nsecond line"),
            ),
            Route("keys_only", "*.k", "cap"),
        ]
    )
    cap = CaptureSink()
    async with open_routing_sink(
        config, SCHEMA, {"cap": cap, "d": NullSink()}, "d", hooks=hooks
    ) as sink:
        odd = sink.trace(Q, step=3)
        assert [(v.route, v.verdict, v.reason) for v in odd.verdicts] == [
            ("raw", "match", None),
            ("even_steps", "skip", "odd step"),
            ("keys_only", "not_reached", None),
        ]
        assert odd.destinations == ["cap"]
        even = sink.trace(Q, step=2)
        assert [v.verdict for v in even.verdicts] == ["match", "match", "not_reached"]
        # Trace refuses what submission would refuse: an unbound hook is not
        # traced (least of all as output_id 0, another hook's).
        with pytest.raises(UnboundOutputId, match="hook 'mlp.0' was never bound"):
            sink.trace("mlp.0")
        hooks.bind("mlp.0")
        nowhere = sink.trace("mlp.0")
        assert [v.verdict for v in nowhere.verdicts] == ["bypassed"] * 3
        assert nowhere.destinations == ["d"] and not nowhere.dropped
        # The same predicate applies to real traffic, and declines are counted.
        batch = vec_batch(q, 4)
        desc = batch.descriptors.copy()
        desc["step"] = [0, 1, 2, 3]
        SCRIPT.broken = False
        await sink.submit(RecordBatch.from_buffer(desc, batch.payload))
        await sink.flush()
        route = sink.counters().routes["even_steps"]
    assert route.declined == 2 and route.last_decline == "odd step"
    assert cap.rows("even_steps")["seq"].tolist() == [0, 2]
    assert SCRIPT.calls == []


def test_accounting_is_exact_under_random_faults(tmp_path):
    """records in = delivered + dead-lettered + dropped, across random failures."""
    rng = random.Random(1234)
    n_batches, per_batch = 40, 8
    total = n_batches * per_batch
    SCRIPT.bad_seqs = {s for s in range(total) if rng.random() < 0.1}
    SCRIPT.transient_seqs = {s: rng.randint(1, 3) for s in range(total) if rng.random() < 0.15}
    store = DeadLetterStore(tmp_path / "dead.sqlite")

    async def main() -> tuple[int, int]:
        hooks = HookRegistry()
        store.attach_hooks(hooks)
        q = hooks.bind(Q, layout="vec")
        hooks.bind("unrouted", layout="vec")
        out = CaptureSink()
        policy = FailurePolicy(deadline=0, initial_backoff=0.5, max_failures=2, failure_window=1)
        route = Route(
            "r",
            Q,
            "out",
            mode="stateless",
            processor="fail.by_seq",
            workers=2,
            failure_policy=policy,
        )
        async with one_route_sink(route, out, hooks=hooks, on_failure=store.handle) as sink:
            for i in range(n_batches):
                ids = np.where(np.arange(per_batch) % 5 == 4, 1, q).astype(np.uint32)
                await sink.submit(vec_batch(0, per_batch, seq_start=i * per_batch, output_ids=ids))
            await sink.flush()
            await trio.sleep(30)  # let every retry finish or give up
            counters = sink.counters()
        delivered = len(out.rows("r"))
        return delivered, counters.unmatched_dropped

    delivered, dropped = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    dead = len(store.list(state=None))
    assert dropped == n_batches  # record 4 of each batch comes from an unrouted hook
    assert delivered + dead + dropped == total
    assert dead >= len({s for s in SCRIPT.bad_seqs if s % 5 != 4})
    store.close()


async def test_a_closed_destination_dead_letters_its_records_as_binding_invalid():
    hooks, q = hooks_with_q()
    gone = CaptureSink()
    await gone.close()  # the destination went away
    failures: list[RecordFailure] = []
    async with open_routing_sink(
        RoutingConfig([Route("raw", Q, "gone")]),
        SCHEMA,
        {"gone": gone},
        unmatched="drop",
        hooks=hooks,
        on_failure=failures.append,
    ) as sink:
        await sink.submit(vec_batch(q, 3))
        await sink.flush()
        assert sink.failure is None  # the router keeps going
        counters = sink.counters()
    (failure,) = failures
    assert failure.code is FailureCode.BINDING_INVALID and len(failure.records) == 3
    assert "SinkClosed" in failure.message
    assert counters.routes["raw"].failed == 3
    assert counters.destinations["gone"].errors == 1


async def test_parked_records_are_bounded_and_apply_backpressure(mock_clock):
    hooks, q = hooks_with_q()
    SCRIPT.failures_left[3] = 1
    policy = FailurePolicy(deadline=0, max_parked_records=2, initial_backoff=2)
    route = Route(
        "keyed",
        Q,
        "out",
        mode="stateful",
        processor="fail.keyed_log",
        failure_policy=policy,
        capacity=1,
    )
    submitted = 0
    async with open_routing_sink(
        RoutingConfig([route]), SCHEMA, {"out": NullSink()}, unmatched="drop", hooks=hooks
    ) as sink:

        async def producer() -> None:
            nonlocal submitted
            for seq in range(4):  # all key 3: the first fails, the rest wait behind it
                await sink.submit(vec_batch(q, 1, keys=[3], seq_start=seq))
                submitted += 1

        async with trio.open_nursery() as nursery:
            nursery.start_soon(producer)
            while sink.counters().routes["keyed"].parked < 3:
                await trio.testing.wait_all_tasks_blocked()
                await trio.lowlevel.checkpoint()
            await trio.testing.wait_all_tasks_blocked()
            # At the bound the route takes no more: 2 parked + the 1 its mailbox
            # already held; the producer waits for room instead of adding more.
            assert sink.counters().routes["keyed"].parked == 3
            assert submitted == 3
            mock_clock.jump(2)  # the retry succeeds; the held records drain; room again
        await sink.flush()
    assert submitted == 4
    assert SCRIPT.log == [(3, 0), (3, 1), (3, 2), (3, 3)]
