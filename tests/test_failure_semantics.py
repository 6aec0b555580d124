"""Failure semantics of issue #10: what a panic is, give-ups always logged,
counting, stateful isolation, leases on every exit path, predicates."""

from __future__ import annotations

import logging
import threading

import pytest
import trio
import trio.testing

from taproute.actors import open_routing_sink
from taproute.native import StateRegion
from taproute.routing import (
    FailureCode,
    FailurePolicy,
    HookRegistry,
    InvalidInput,
    RecordFailure,
    Route,
    RoutingConfig,
)
from taproute.routing.failures import classify
from taproute.service import CaptureSink, DeadLetterStore
from tests.conftest import one_route_sink, vec_batch
from tests.failing_processors import SCRIPT
from tests.processors import SCHEMA

Q = "layers.0.q"
NO_DEADLINE = FailurePolicy(deadline=0)


@pytest.fixture(autouse=True)
def fresh_script():
    SCRIPT.reset()
    yield
    SCRIPT.release_hang.set()


def hooks_with_q() -> tuple[HookRegistry, int]:
    hooks = HookRegistry()
    return hooks, hooks.bind(Q, layout="vec")


# -- #10.8: what a panic is -------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (ConnectionError("reset"), FailureCode.HANDLER_FAILED),
        (TimeoutError("slow"), FailureCode.HANDLER_FAILED),
        (OSError("disk"), FailureCode.HANDLER_FAILED),
        (RuntimeError("CUDA busy"), FailureCode.HANDLER_FAILED),
        (InvalidInput("bad"), FailureCode.HANDLER_INVALID),
        (TypeError("x"), FailureCode.HANDLER_PANIC),
        (AttributeError("x"), FailureCode.HANDLER_PANIC),
        (NameError("x"), FailureCode.HANDLER_PANIC),
        (AssertionError(), FailureCode.HANDLER_PANIC),
        (KeyError(3), FailureCode.HANDLER_PANIC),
        (ZeroDivisionError(), FailureCode.HANDLER_PANIC),
        (ValueError("x"), FailureCode.HANDLER_PANIC),
    ],
)
def test_panic_means_a_bug_class_and_everything_else_is_transient(error, code):
    assert classify(error) is code


async def test_a_connection_error_is_retried_with_backoff_and_recovers(mock_clock):
    SCRIPT.failures_left[-2] = 2
    hooks, q = hooks_with_q()
    out = CaptureSink()
    failures: list[RecordFailure] = []
    route = Route(
        "r",
        Q,
        "out",
        mode="stateless",
        processor="fail.connection_then_ok",
        failure_policy=NO_DEADLINE,
    )
    async with one_route_sink(route, out, hooks=hooks, on_failure=failures.append) as sink:
        await sink.submit(vec_batch(q, 3))
        await sink.flush()
        assert sink.counters().routes["r"].parked == 3  # waiting for its backoff
        for backoff in (2, 4):
            mock_clock.jump(backoff)
            await trio.testing.wait_all_tasks_blocked()
            await sink.flush()
        counters = sink.counters().routes["r"]
    assert failures == []
    assert out.rows("r")["seq"].tolist() == [0, 1, 2]
    assert counters.failures_by_code == {"handler_failed": 6}
    assert counters.recovered == 3 and counters.processed == 3


async def test_a_bug_in_the_processor_is_a_panic_given_up_at_once(autojump_clock):
    hooks, q = hooks_with_q()
    failures: list[RecordFailure] = []
    route = Route(
        "r", Q, "out", mode="stateless", processor="fail.type_error", failure_policy=NO_DEADLINE
    )
    async with open_routing_sink(
        RoutingConfig([route]),
        SCHEMA,
        {"out": CaptureSink()},
        unmatched="drop",
        hooks=hooks,
        on_failure=failures.append,
    ) as sink:
        await sink.submit(vec_batch(q, 1))
        await sink.flush()
    (failure,) = failures
    assert failure.code is FailureCode.HANDLER_PANIC and failure.attempts == 1
    assert "in type_error" in (failure.traceback or "")


# -- #10.11: give-ups are logged whatever the handler ----------------------------------


async def test_give_ups_are_logged_with_the_dead_letter_store_as_handler(tmp_path, caplog):
    hooks, q = hooks_with_q()
    store = DeadLetterStore(tmp_path / "letters.sqlite")
    route = Route(
        "r", Q, "out", mode="stateless", processor="fail.panics", failure_policy=NO_DEADLINE
    )
    with caplog.at_level(logging.WARNING, logger="taproute.routing"):
        async with open_routing_sink(
            RoutingConfig([route]),
            SCHEMA,
            {"out": CaptureSink()},
            unmatched="drop",
            hooks=hooks,
            on_failure=store.handle,
        ) as sink:
            for seq in range(25):  # 25 give-ups of one record each
                await sink.submit(vec_batch(q, 1, seq_start=seq))
            await sink.flush()
            assert sink.counters().routes["r"].failed == 25
    store.close()
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    given_up = [line for line in lines if "given up" in line]
    assert len(given_up) == 10  # rate-limited: 10 lines per route per minute
    assert all("route 'r'" in line and "[handler_panic]" in line for line in given_up)


# -- #10.2: a forward route counts a record once: processed or failed ------------------


async def test_a_forward_route_counts_processed_only_once_its_destination_took_it():
    hooks, q = hooks_with_q()
    gone, live = CaptureSink(), CaptureSink()
    await gone.close()
    failures: list[RecordFailure] = []
    config = RoutingConfig([Route("to_gone", Q, "gone"), Route("to_live", Q, "live")])
    async with open_routing_sink(
        config,
        SCHEMA,
        {"gone": gone, "live": live},
        unmatched="drop",
        hooks=hooks,
        on_failure=failures.append,
    ) as sink:
        await sink.submit(vec_batch(q, 3))
        await sink.flush()
        counters = sink.counters().routes
    refused, took = counters["to_gone"], counters["to_live"]
    assert (refused.processed, refused.emitted, refused.failed) == (0, 0, 3)
    assert (took.processed, took.emitted, took.failed) == (3, 3, 0)
    assert [len(f.records) for f in failures] == [3]


# -- #10.1: the Trio API checks batches as the runtime does ------------------------------


def _raw(q: int, *, output_id=None, length=16, offsets=None, layout_id=None, payload=None):
    import numpy as np

    from taproute.native import make_descriptors
    from taproute.routing import RecordBatch

    desc = make_descriptors(
        q if output_id is None else output_id,
        length,
        count=2,
        layout_ids=SCHEMA.layout_id("vec") if layout_id is None else layout_id,
    )
    if offsets is not None:
        desc["offset"] = offsets
    data = np.zeros((2, 4), np.float32) if payload is None else payload
    return RecordBatch.from_buffer(desc, data)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"output_id": 7}, "output_id 7 was never bound"),
        ({"length": 12}, "payload"),
        ({"offsets": [0, 64]}, "outside the 32-byte buffer"),
        ({"layout_id": 99}, "layout_id 99 is not in the schema"),
    ],
)
async def test_routing_sink_submit_refuses_a_batch_the_runtime_refuses(change, message):
    from taproute.routing.errors import RecordError

    hooks, q = hooks_with_q()
    out = CaptureSink()
    async with open_routing_sink(
        RoutingConfig([Route("raw", Q, "out")]),
        SCHEMA,
        {"out": out},
        default_destination="out",
        hooks=hooks,
    ) as sink:
        bad = _raw(q, **change)
        with pytest.raises(RecordError, match=message):
            await sink.submit(bad)
        await sink.submit(_raw(q))  # a good batch still goes through
        await sink.flush()
        assert bad.lease.holders == 1  # nothing took a lease on the refused batch
    assert len(out.batches) == 1 and len(out.batches[0]) == 2


# -- #10.3: a failed stateful call leaves no trace in state --------------------------------


async def test_stateful_isolation_applies_each_good_record_once():
    hooks, q = hooks_with_q()
    out = CaptureSink()
    failures: list[RecordFailure] = []
    route = Route(
        "sums", Q, "out", mode="stateful", processor="fail.running_sum", failure_policy=NO_DEADLINE
    )
    async with one_route_sink(route, out, hooks=hooks, on_failure=failures.append) as sink:
        await sink.submit(vec_batch(q, 4, keys=[3, 3, 5, 3]))
        await sink.flush()
        counters = sink.counters().routes["sums"]
    rows = out.rows("sums")
    assert rows[rows["key"] == 3]["norm"].tolist() == [1.0, 2.0, 3.0]
    assert [int(f.records.descriptors["key"][0]) for f in failures] == [5]
    assert counters.processed == 3 and counters.failed == 1


async def test_the_rollback_save_is_made_in_the_processors_worker_thread(monkeypatch):
    """One thread hop carries the save and the call: the loop thread saves nothing
    (and the isolation above still finds each good record applied once)."""
    saved_in: list[int] = []
    save = StateRegion.save

    def recorded(self, keys, owner):
        saved_in.append(threading.get_ident())
        return save(self, keys, owner)

    monkeypatch.setattr(StateRegion, "save", recorded)
    await test_stateful_isolation_applies_each_good_record_once()
    assert len(saved_in) == 3  # the batch, then each key's records in one call of their own
    assert threading.get_ident() not in saved_in


# -- #10.4: every accepted batch is released once, on every exit path ------------------------


async def _leave_with_batches_queued(how: str, mode: str) -> list[int]:
    from tests.sinks import GateSink

    hooks, q = hooks_with_q()
    slow = GateSink()  # takes nothing until its gate opens (never, here)
    released = [0, 0, 0, 0]
    all_released = trio.Event()

    def release(i: int):
        def done() -> None:
            released[i] += 1
            if all(released):
                all_released.set()

        return done

    processor = {"forward": None, "stateless": "fail.hangs", "stateful": "fail.keyed_log"}[mode]
    route = Route("r", Q, "slow", mode=mode, processor=processor, failure_policy=NO_DEADLINE)
    with trio.CancelScope() as scope:
        try:
            async with open_routing_sink(
                RoutingConfig([route]), SCHEMA, {"slow": slow}, unmatched="drop", hooks=hooks
            ) as sink:
                for i in range(4):
                    batch = vec_batch(q, 2, seq_start=2 * i, release=release(i))
                    await sink.submit(batch)
                    batch.lease.release()  # the submitter's own hold
                await trio.testing.wait_all_tasks_blocked()
                if how == "exception":
                    raise KeyError("the caller's own bug")
                scope.cancel()
                await trio.sleep_forever()
        except KeyError:
            assert how == "exception"
    SCRIPT.release_hang.set()  # a processor thread still running lets its batch go on return
    await all_released.wait()
    await trio.testing.wait_all_tasks_blocked()  # a second release would run by now
    return released


@pytest.mark.parametrize("mode", ["forward", "stateless", "stateful"])
@pytest.mark.parametrize("how", ["exception", "cancellation"])
async def test_leaving_open_routing_sink_early_releases_every_batch_once(how, mode):
    with trio.fail_after(60):
        assert await _leave_with_batches_queued(how, mode) == [1, 1, 1, 1]


# -- #10.5: the buffer stays held while an abandoned processor still reads it ---------------


async def test_a_timed_out_processor_keeps_its_buffer_until_it_returns():
    hooks, q = hooks_with_q()
    released = trio.Event()
    given_up: list[RecordFailure] = []
    route = Route(
        "r",
        Q,
        "out",
        mode="stateless",
        processor="fail.hangs",
        failure_policy=FailurePolicy(deadline=0.2, max_failures=1, failure_window=0),
    )
    with trio.fail_after(60):
        async with open_routing_sink(
            RoutingConfig([route]),
            SCHEMA,
            {"out": CaptureSink()},
            unmatched="drop",
            hooks=hooks,
            on_failure=given_up.append,
        ) as sink:
            batch = vec_batch(q, 1, release=released.set)
            await sink.submit(batch)
            batch.lease.release()
            await sink.flush()  # the give-up does not wait for the abandoned thread
            assert [f.code for f in given_up] == [FailureCode.HANDLER_TIMEOUT]
            assert not released.is_set()  # the processor thread still reads the buffer
            assert sink.counters().routes["r"].abandoned_calls == 1
            SCRIPT.release_hang.set()  # the processor returns...
            await released.wait()  # ...and only then is the buffer let go
            assert sink.counters().routes["r"].abandoned_calls == 0


# -- #10.9: predicates run under the route's deadline; a failure is the route's ------------


async def test_a_slow_or_raising_predicate_fails_its_route_not_the_router():
    import threading

    stuck = threading.Event()

    def slow(descriptors):
        stuck.wait(30)
        return descriptors["step"] >= 0

    def raising(descriptors):
        raise ConnectionError("label service unreachable")

    policy = FailurePolicy(deadline=0.2, max_failures=1, failure_window=0)
    # The raising predicate gets a generous deadline: its thread can take over
    # 0.2 s to start on a loaded machine, and it must fail by raising.
    generous = FailurePolicy(deadline=60, max_failures=1, failure_window=0)
    config = RoutingConfig(
        [
            Route("slow", Q, "out", predicate=slow, failure_policy=policy),
            Route("raising", Q, "out", predicate=raising, failure_policy=generous),
            Route("plain", Q, "out"),
        ]
    )
    hooks, q = hooks_with_q()
    out = CaptureSink()
    failures: list[RecordFailure] = []
    try:
        with trio.fail_after(60):
            async with open_routing_sink(
                config,
                SCHEMA,
                {"out": out},
                unmatched="drop",
                hooks=hooks,
                on_failure=failures.append,
            ) as sink:
                await sink.submit(vec_batch(q, 3))
                await sink.flush()
                assert sink.failure is None  # no router-wide latch
                counters = sink.counters().routes
    finally:
        stuck.set()
    by_route = {f.route: f for f in failures}
    assert by_route["slow"].code is FailureCode.HANDLER_TIMEOUT
    assert by_route["raising"].code is FailureCode.HANDLER_FAILED
    assert "ConnectionError: label service unreachable" in str(by_route["raising"].error)
    assert counters["slow"].failed == 3 and counters["raising"].failed == 3
    assert counters["slow"].failures_by_code == {"handler_timeout": 3}
    assert counters["plain"].processed == 3 and len(out.batches) == 1


async def test_a_stateful_call_abandoned_before_its_save_never_touches_the_state(monkeypatch):
    """The rollback save runs in the call's worker thread: a call given up at its
    deadline before that thread saved anything must not save (into the buffer the
    owner's next call saves into) nor apply its records later, when the thread
    gets to run: the timed-out record is dead-lettered, so applying it too would
    count it twice on a reroute."""
    go = threading.Event()
    save = StateRegion.save
    first = [True]

    def slow_first_save(self, keys, owner):
        if first[0]:
            first[0] = False
            go.wait(30)  # the thread is descheduled here until the call was given up
        return save(self, keys, owner)

    monkeypatch.setattr(StateRegion, "save", slow_first_save)
    hooks, q = hooks_with_q()
    out = CaptureSink()
    given_up: list[RecordFailure] = []
    released = trio.Event()
    route = Route(
        "sums",
        Q,
        "out",
        mode="stateful",
        processor="fail.running_sum",
        failure_policy=FailurePolicy(deadline=0.2, max_failures=1, failure_window=0),
    )
    with trio.fail_after(60):
        async with one_route_sink(route, out, hooks=hooks, on_failure=given_up.append) as sink:
            abandoned = vec_batch(q, 1, keys=[3], release=released.set)
            await sink.submit(abandoned)
            abandoned.lease.release()
            await sink.flush()
            assert [f.code for f in given_up] == [FailureCode.HANDLER_TIMEOUT]
            go.set()  # the abandoned thread runs on...
            await released.wait()  # ...and is done with the batch
            await sink.submit(vec_batch(q, 2, keys=[3, 3]))
            await sink.flush()
    # Key 3's state holds the two delivered records only.
    assert out.rows("sums")["norm"].tolist() == [1.0, 2.0]
