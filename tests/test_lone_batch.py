"""A batch that arrives alone takes fewer hops: the record worker makes a quick
stateless route's call itself when the route's pool is idle, and a deliverer
submits to an idle destination's sink itself.  Neither skips the failure
policy, flush, the one-submit-at-a-time promise or backpressure."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import trio
import trio.testing

from taproute.actors import open_routing_sink
from taproute.actors.attempt import INLINE_TRUSTED, timed_call
from taproute.routing import (
    FailureCode,
    FailurePolicy,
    HookRegistry,
    RecordFailure,
    Records,
    Route,
    RoutingConfig,
    stateless_processor,
)
from taproute.service import CaptureSink
from tests.conftest import vec_batch
from tests.processors import NORM, SCHEMA

Q = "layers.0.q"
CALLS: list[int] = []  # the thread of each call
BAD: set[int] = set()  # seqs that make the processor raise a bug class (not retried)
FLAKY: dict[int, int] = {}  # seq -> transient failures still to give


@stateless_processor("lone.norms", input="vec", output="norm")
def lone_norms(records: Records) -> np.ndarray:
    CALLS.append(threading.get_ident())
    seqs = records.descriptors["seq"]
    for seq in seqs.tolist():
        if seq in BAD:
            raise ValueError(f"bad record {seq}")
        if FLAKY.get(seq, 0):
            FLAKY[seq] -= 1
            raise ConnectionError("feature store restarting")
    rows = np.zeros(len(records), dtype=NORM.dtype)
    rows["seq"] = seqs
    return rows


@pytest.fixture(autouse=True)
def quick_calls(monkeypatch):
    """Every call is timed as quick (what is proved is where calls run, not how
    fast a loaded machine runs them); the logs start empty."""
    CALLS.clear()
    BAD.clear()
    FLAKY.clear()

    def timed(fn, *args, **kwargs):
        result, _ = timed_call(fn, *args, **kwargs)
        return result, 0.0

    monkeypatch.setattr("taproute.actors.attempt.timed_call", timed)


def _config(**kw) -> RoutingConfig:
    route = Route("r", Q, "out", mode="stateless", processor="lone.norms", workers=2, **kw)
    return RoutingConfig([route])


async def _lone_batches(sink, q: int, batches: int, size: int = 4) -> None:
    """Submit batches one at a time, each once the router is idle again."""
    for i in range(batches):
        await trio.testing.wait_all_tasks_blocked()
        await sink.submit(vec_batch(q, size, seq_start=size * i))


async def test_a_lone_batch_is_processed_by_the_record_worker_and_flush_waits_for_it():
    hooks = HookRegistry()
    q = hooks.bind(Q, layout="vec")
    out = CaptureSink()
    async with open_routing_sink(_config(), SCHEMA, {"out": out}, "out", hooks=hooks) as sink:
        route = sink._gen.routes[0]
        route.placement.quick = INLINE_TRUSTED  # a quick processor, on the loop
        await _lone_batches(sink, q, 10)
        await sink.flush()
        assert route.made_here == 10 and route.failed_here == 0
        assert set(CALLS) == {threading.get_ident()}  # the loop's thread, no hop
        counters = sink.snapshot()
    assert sorted(out.rows("r")["seq"].tolist()) == list(range(40))
    r = counters.routes["r"]
    assert (r.accepted, r.processed, r.emitted, r.backlog) == (40, 40, 40, 0)


async def test_a_failed_call_of_the_record_worker_follows_the_failure_policy():
    hooks = HookRegistry()
    q = hooks.bind(Q, layout="vec")
    out = CaptureSink()
    failures: list[RecordFailure] = []
    BAD.add(5)
    policy = FailurePolicy(max_failures=1, failure_window=0, deadline=0)
    async with open_routing_sink(
        _config(failure_policy=policy),
        SCHEMA,
        {"out": out},
        "out",
        hooks=hooks,
        on_failure=failures.append,
    ) as sink:
        route = sink._gen.routes[0]
        route.placement.quick = INLINE_TRUSTED
        await _lone_batches(sink, q, 3)
        await sink.flush()
        assert route.made_here >= 1 and route.failed_here == 1
    # Only the bad record is given up (the batch was re-run record by record).
    assert sorted(out.rows("r")["seq"].tolist()) == [s for s in range(12) if s != 5]
    (failure,) = failures
    assert failure.code is FailureCode.HANDLER_PANIC
    assert failure.records.descriptors["seq"].tolist() == [5]


async def test_a_transient_failure_of_the_record_worker_is_retried_after_its_backoff(
    autojump_clock,
):
    hooks = HookRegistry()
    q = hooks.bind(Q, layout="vec")
    out = CaptureSink()
    failures: list[RecordFailure] = []
    FLAKY[2] = 2  # fails twice, then succeeds
    policy = FailurePolicy(deadline=0, initial_backoff=2.0)
    async with open_routing_sink(
        _config(failure_policy=policy),
        SCHEMA,
        {"out": out},
        "out",
        hooks=hooks,
        on_failure=failures.append,
    ) as sink:
        route = sink._gen.routes[0]
        route.placement.quick = INLINE_TRUSTED
        started = trio.current_time()
        await _lone_batches(sink, q, 1)
        await sink.flush(wait=True)
        assert route.failed_here == 1
        assert trio.current_time() - started >= 2.0 + 4.0  # two backoffs waited
        counters = sink.snapshot()
    assert failures == []
    assert sorted(out.rows("r")["seq"].tolist()) == [0, 1, 2, 3]
    r = counters.routes["r"]
    assert (r.processed, r.recovered, r.failed) == (4, 4, 0)


class OneAtATime:
    """A sink whose submit yields to the loop midway, and which records any
    second submit that began before the first returned."""

    def __init__(self) -> None:
        self.inside = False
        self.overlaps = 0
        self.seen: list[tuple[str | None, int]] = []

    async def submit(self, batch) -> None:
        if self.inside:
            self.overlaps += 1
        self.inside = True
        try:
            await trio.sleep(0)
            seq = batch.rows["seq"] if hasattr(batch, "rows") else batch.descriptors["seq"]
            self.seen.append((getattr(batch, "route", None), int(seq[0])))
        finally:
            self.inside = False

    async def flush(self) -> None:
        pass

    async def close(self) -> None:
        pass


async def test_deliverers_submit_to_an_idle_sink_themselves_one_at_a_time_in_order():
    hooks = HookRegistry()
    q = hooks.bind(Q, layout="vec")
    sink_ = OneAtATime()
    config = RoutingConfig(
        [
            Route("f", Q, "out"),  # forward: the record worker delivers
            Route("r", Q, "out", mode="stateless", processor="lone.norms", workers=2),
        ]
    )
    async with open_routing_sink(config, SCHEMA, {"out": sink_}, "out", hooks=hooks) as sink:
        actor = sink._destinations["out"]
        actor.placement.quick = INLINE_TRUSTED  # its submits have been quick
        for i in range(30):  # lone batches, then bursts: both paths, interleaved
            if i < 10:
                await trio.testing.wait_all_tasks_blocked()
            await sink.submit(vec_batch(q, 4, seq_start=4 * i))
        await sink.flush()
        assert actor.submitted_here > 0
        counters = sink.snapshot()
    assert sink_.overlaps == 0
    forward = [seq for route, seq in sink_.seen if route is None]
    assert forward == sorted(forward) and len(forward) == 30  # one route's order kept
    assert sorted(seq for route, seq in sink_.seen if route == "r") == list(range(0, 120, 4))
    out = counters.destinations["out"]
    assert (out.batches, out.records) == (60, 240)
