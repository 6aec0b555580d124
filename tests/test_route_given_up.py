"""Records an unexpected failure cuts short are counted: a route's ``given_up``,
and the runtime's when its loop dies.

A route actor's catch-all (a stateless pool worker, the record worker's own
attempt in ``dispatch_here``, a stateful owner admitting one batch, several
in one hop, or retrying a held key) latched an unexpected exception and let
the attempt's records go uncounted: neither processed, dead-lettered,
dropped nor parked, so ``accepted`` no longer added up.  Each now counts the
records its attempt had not settled as ``given_up``
(``taproute_route_given_up_records_total``); records it had settled before
the failure (an isolation's processed and dead-lettered singles) stay where
they are.

How the failure is caused: on main a processor's output could make the
output check itself raise (an ``Array`` column holding a list of torch
tensors that require grad: ``np.asarray`` raises RuntimeError, not the
ValueError the check expects), which reached every one of these paths; the
next commit makes such an output a per-record failure (dead-lettered), so
no real input reaches them any more.  The tests therefore inject the fault:
the output check (``attempt.judged``, or the one-hop call for several
batches) is monkeypatched to raise for marked records, standing for any
internal invariant a future bug breaks.  The loop-death test needs no
injection: a record sink that calls ``sys.exit()`` kills the loop for real.
"""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest
import trio
import trio.testing

import taproute.actors.attempt as attempt_module
from taproute.actors import open_routing_sink
from taproute.actors.attempt import INLINE_TRUSTED
from taproute.native import make_descriptors
from taproute.routing import (
    FailurePolicy,
    HookRegistry,
    Records,
    Route,
    RoutingConfig,
    SlotSpec,
    stateful_processor,
    stateless_processor,
)
from taproute.routing.errors import RoutingFailure, SinkClosed
from taproute.service import CaptureSink, create_record_runtime
from tests.conftest import vec_batch
from tests.processors import NORM, SCHEMA
from tests.sinks import NullSink
from tests.test_runtime import Q, eventually, vec_payload

HANG_GUARD_S = 60.0
KEYS = 16
BROKEN: set[int] = set()  # seqs whose output check raises (the injected fault)
PANIC: set[int] = set()  # seqs that make the processor raise a bug class (isolated, given up)
FLAKY: dict[int, int] = {}  # seq -> transient failures still to give (parked, retried)
GATE = threading.Event()  # a call holding a GATED seq waits for it (in its worker thread)
GATED: set[int] = set()
ENTERED = threading.Event()


def _rows(records: Records) -> np.ndarray:
    seqs = records.descriptors["seq"]
    for seq in seqs.tolist():
        if seq in GATED:
            ENTERED.set()
            assert GATE.wait(HANG_GUARD_S)
        if seq in PANIC:
            raise ValueError(f"bad record {seq}")
        if FLAKY.get(seq, 0):
            FLAKY[seq] -= 1
            raise ConnectionError("feature store restarting")
    rows = np.zeros(len(records), dtype=NORM.dtype)
    rows["key"] = records.descriptors["key"]
    rows["seq"] = seqs
    return rows


@stateless_processor("given_up.rows", input="vec", output="norm")
def stateless_rows(records: Records) -> np.ndarray:
    return _rows(records)


@stateful_processor(
    "given_up.keyed_rows",
    key=lambda d: d["key"] % KEYS,
    key_range=KEYS,
    slot=SlotSpec((1,), "float64"),
    input="vec",
    output="norm",
)
def keyed_rows(records: Records, keys: np.ndarray, state) -> np.ndarray:
    rows = _rows(records)
    np.add.at(state.slots[:, 0], keys, 1)
    return rows


class InvariantBroken(RuntimeError):
    """What the injected fault raises."""


@pytest.fixture(autouse=True)
def broken_check(monkeypatch):
    """The output check raises for rows of a seq in ``BROKEN`` (fault injection:
    see the module docstring); the sets start empty."""
    for marks in (BROKEN, PANIC, FLAKY, GATED):
        marks.clear()
    GATE.clear()
    ENTERED.clear()
    real = attempt_module.judged

    def judged(planned, result):
        if isinstance(result, np.ndarray) and BROKEN & set(result["seq"].tolist()):
            raise InvariantBroken("the output check broke an internal invariant")
        return real(planned, result)

    monkeypatch.setattr("taproute.actors.attempt.judged", judged)


def _config(mode: str, **kw) -> RoutingConfig:
    processor = "given_up.rows" if mode == "stateless" else "given_up.keyed_rows"
    return RoutingConfig([Route("r", Q, "out", mode=mode, processor=processor, **kw)])


def _adds_up(r) -> bool:
    return r.accepted == r.processed + r.failed + r.dropped + r.given_up + r.parked


async def _run(config: RoutingConfig, where: str, body, **options):
    """Run ``body(sink, route, q)`` on a routing sink; it ends with a flush
    that raises the latched failure (naming ``where``); returns the route's
    counters and the sink."""
    hooks = HookRegistry()
    q = hooks.bind(Q, layout="vec")
    out = CaptureSink()
    snapshot = None
    with pytest.raises(RoutingFailure, match=where) as raised:
        async with open_routing_sink(
            config, SCHEMA, {"out": out}, "out", hooks=hooks, **options
        ) as sink:
            route = sink._gen.routes[0]
            try:
                await body(sink, route, q)
            finally:
                snapshot = sink.snapshot()
    assert isinstance(raised.value.cause, InvariantBroken)
    assert snapshot is not None
    return snapshot.routes["r"], route, out


async def test_a_stateless_worker_cut_short_counts_its_batch_given_up():
    BROKEN.add(5)

    async def body(sink, route, q):
        await sink.submit(vec_batch(q, 4))
        await sink.flush()
        await sink.submit(vec_batch(q, 4, seq_start=4))
        await sink.flush()

    r, route, out = await _run(_config("stateless", workers=1), "stateless worker", body)
    assert route.made_here == 0  # a pool worker's attempt
    # Before: given_up did not exist and 4 of the 8 accepted were nowhere.
    assert (r.accepted, r.processed, r.given_up, r.failed, r.backlog) == (8, 4, 4, 0, 0)
    assert _adds_up(r) and len(out.rows("r")) == 4


async def test_an_isolation_cut_short_counts_only_the_records_it_had_not_settled():
    PANIC.add(9)  # the batch fails; re-run record by record: 8 ok, 9 dead-lettered
    BROKEN.add(10)  # then 10's output check breaks: 10 and 11 are left
    dead: list[object] = []

    async def body(sink, route, q):
        await sink.submit(vec_batch(q, 4, seq_start=8))
        await sink.flush()

    r, _, out = await _run(
        _config("stateless", workers=1), "stateless worker", body, on_failure=dead.append
    )
    assert (r.accepted, r.processed, r.failed, r.given_up) == (4, 1, 1, 2)
    assert _adds_up(r) and out.rows("r")["seq"].tolist() == [8] and len(dead) == 1


async def test_the_record_workers_own_attempt_cut_short_counts_its_batch_given_up():
    BROKEN.add(13)

    async def body(sink, route, q):
        for start in (0, 4, 8):
            await trio.testing.wait_all_tasks_blocked()  # the pool idle again
            route.placement.quick = INLINE_TRUSTED  # a quick processor: the loop calls it
            await sink.submit(vec_batch(q, 4, seq_start=start))
        await trio.testing.wait_all_tasks_blocked()
        route.placement.quick = INLINE_TRUSTED
        await sink.submit(vec_batch(q, 4, seq_start=12))
        await sink.flush()

    r, route, _ = await _run(
        _config("stateless", workers=2), "stateless attempt in the record worker", body
    )
    assert route.made_here == 4 and route.failed_here == 0
    assert (r.accepted, r.processed, r.given_up, r.backlog) == (16, 12, 4, 0)
    assert _adds_up(r)


async def test_a_stateful_owner_admitting_one_batch_cut_short_counts_it_given_up():
    BROKEN.add(6)

    async def body(sink, route, q):
        await sink.submit(vec_batch(q, 4))
        await sink.flush()
        await sink.submit(vec_batch(q, 4, seq_start=4))
        await sink.flush()

    r, _, _ = await _run(_config("stateful", workers=1), "stateful owner", body)
    assert (r.accepted, r.processed, r.given_up, r.backlog) == (8, 4, 4, 0)
    assert _adds_up(r)


async def test_a_stateful_owner_admitting_batches_in_one_hop_cut_short_counts_them(
    monkeypatch,
):
    """Three batches queued behind a call that waits are admitted together;
    the one-hop call is made to raise (fault injection) for them."""
    real_hop = sys.modules["taproute.actors.owners"].call_processor_in_one_hop
    hops: list[int] = []

    async def broken_hop(planned, calls, **kw):
        hops.append(len(calls))
        raise InvariantBroken("the one-hop call broke an internal invariant")

    monkeypatch.setattr("taproute.actors.owners.call_processor_in_one_hop", broken_hop)
    assert real_hop is not broken_hop
    GATED.add(0)

    async def body(sink, route, q):
        await sink.submit(vec_batch(q, 4))  # its call waits for GATE in a worker thread
        await trio.to_thread.run_sync(ENTERED.wait, HANG_GUARD_S)
        for start in (4, 8, 12):
            await sink.submit(vec_batch(q, 4, seq_start=start))
        GATE.set()
        await sink.flush()

    r, _, _ = await _run(_config("stateful", workers=1), "stateful owner", body)
    assert hops == [3]
    assert (r.accepted, r.processed, r.given_up, r.backlog) == (16, 4, 12, 0)
    assert _adds_up(r)


async def test_a_held_keys_retry_cut_short_counts_its_records_given_up(autojump_clock):
    """No call deadline (0): under the autojump clock a call in a worker
    thread would outlive any, and time out (retried again) at random."""
    FLAKY[2] = 1  # parked once, its key held
    BROKEN.add(2)  # the retry's output check breaks

    async def body(sink, route, q):
        await sink.submit(vec_batch(q, 1, seq_start=2))  # one record: seq 2, key 0
        await sink.flush()
        assert sink.snapshot().routes["r"].parked == 1
        await sink.flush(wait=True)  # the retry comes

    r, _, _ = await _run(
        _config("stateful", workers=1, failure_policy=FailurePolicy(max_failures=5, deadline=0)),
        "stateful owner",
        body,
    )
    assert (r.accepted, r.processed, r.given_up, r.parked, r.retries) == (1, 0, 1, 0, 1)
    assert _adds_up(r)


class ExitsOnSecondSubmit(NullSink):
    """A record sink whose first submit waits for ``release`` (stalling the
    loop, so later batches and a flush queue together), and whose second
    calls ``sys.exit()``, which no ``except Exception`` takes: the loop dies."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.stalled = threading.Event()
        self.calls = 0

    async def submit(self, batch) -> None:
        self.calls += 1
        if self.calls == 1:
            self.stalled.set()
            assert self.release.wait(HANG_GUARD_S)
        elif self.calls == 2:
            sys.exit(3)
        await super().submit(batch)


def test_records_taken_when_the_loop_dies_are_given_up_released_and_their_flush_fails():
    """The loop dies (a sink calls ``sys.exit()``) with a batch in the sink's
    submit, a flush and a batch taken with it, and a batch still in ingress:
    each accepted record is counted given up (but the one delivered), every
    buffer goes back once, and the flush fails with the loop's error at once.
    Before: the batch in the submit and what was taken after it went
    uncounted, their buffers were never released, and the flush waited for
    its timeout."""
    sink = ExitsOnSecondSubmit()
    runtime = create_record_runtime(record_sink=sink, schema=SCHEMA)
    released: list[str] = []
    q = runtime.bind_hook(Q, layout="vec")

    def submit(name: str, n: int) -> None:
        runtime.submit_batch(
            make_descriptors(q, 16, count=n, layout_ids=SCHEMA.layout_id("vec")),
            vec_payload(n),
            release=lambda: released.append(name),
        )

    try:
        submit("a", 1)
        assert sink.stalled.wait(HANG_GUARD_S)  # the loop is stuck in a's submit
        submit("b", 2)
        flushed: list[BaseException] = []
        thread = threading.Thread(
            target=lambda: flushed.append(_raised(runtime.flush, HANG_GUARD_S)), daemon=True
        )
        thread.start()
        eventually(lambda: runtime._ingress.queued_sink_controls == 1, timeout=HANG_GUARD_S)
        submit("c", 4)
        sink.release.set()  # a goes in; b, the flush and c are taken together
        thread.join(HANG_GUARD_S)
        assert not thread.is_alive()
        (error,) = flushed
        assert isinstance(error, (RoutingFailure, SinkClosed)), error
        assert "SystemExit" in str(error)
        runtime._thread.join(HANG_GUARD_S)
        submit_after = _raised(submit, "d", 1)
        assert isinstance(submit_after, RoutingFailure)
        ingress = runtime.counters().ingress
        assert ingress.submitted == 7 and sink.records == 1
        assert ingress.given_up == 6  # b and c: not one record uncounted
        assert sorted(released) == ["a", "b", "c"]  # each buffer back, once
    finally:
        sink.release.set()
        with pytest.raises(RoutingFailure, match="SystemExit"):
            runtime.close(timeout=HANG_GUARD_S)


def _raised(fn, *args) -> BaseException | None:
    try:
        fn(*args)
    except BaseException as exc:
        return exc
    return None
