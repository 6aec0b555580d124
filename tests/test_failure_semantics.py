"""Failure semantics of issue #10: what a panic is, give-ups always logged,
counting, stateful isolation, leases on every exit path, predicates."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from taproute.actors import open_routing_sink
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
from tests.conftest import vec_batch
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
    async with open_routing_sink(
        RoutingConfig([route]),
        SCHEMA,
        {"out": out},
        unmatched="drop",
        hooks=hooks,
        on_failure=failures.append,
    ) as sink:
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
