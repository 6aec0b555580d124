"""A stateful owner with a backlog makes its queued batches' calls in one
thread hop (actors/one_hop.py): in order, stopping at the first that fails,
which leaves no trace in the state; each call keeps its own deadline."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator
from typing import Any

import attrs
import numpy as np
import pytest
import trio
import trio.testing

from taproute.actors import owners as owners_module
from taproute.routing import (
    FailureCode,
    FailurePolicy,
    HookRegistry,
    InvalidInput,
    RecordFailure,
    Records,
    Route,
    SlotSpec,
    stateful_processor,
)
from taproute.service import CaptureSink
from tests.conftest import one_route_sink, vec_batch
from tests.processors import KEY_RANGE, NORM

Q = "layers.0.q"


class Knobs:
    def __init__(self) -> None:
        self.gate = threading.Event()  # the first call waits for it
        self.first = True
        self.bad_seqs: set[int] = set()  # malformed records
        self.hang_seq: int | None = None  # the call holding this seq hangs, once
        self.hanging = threading.Event()
        self.release = threading.Event()
        self.slow_seq: int | None = None  # the call holding this seq waits for slow_release
        self.slow_started = threading.Event()
        self.slow_release = threading.Event()


KNOBS = Knobs()


@stateful_processor(
    "hop.count",
    key=lambda d: d["key"],
    key_range=KEY_RANGE,
    slot=SlotSpec((1,), "int64"),
    input="vec",
    output="norm",
)
def count(records: Records, keys: np.ndarray, state) -> np.ndarray:
    """state[k] += 1 per record, record by record (a malformed one raises after
    its predecessors wrote); rows carry each record's running count."""
    if KNOBS.first:
        KNOBS.first = False
        KNOBS.gate.wait(10)
    seqs = records.descriptors["seq"].tolist()
    if KNOBS.slow_seq in seqs:
        KNOBS.slow_started.set()
        KNOBS.slow_release.wait(10)
    if KNOBS.hang_seq in seqs:
        KNOBS.hang_seq = None
        KNOBS.hanging.set()
        KNOBS.release.wait(10)
    rows = np.zeros(len(keys), dtype=NORM.dtype)
    for i, (key, seq) in enumerate(zip(keys.tolist(), seqs, strict=True)):
        state.slots[key] += 1
        if seq in KNOBS.bad_seqs:
            raise InvalidInput(f"record seq {seq} is malformed")
        rows[i] = (key, seq, float(state.slots[key][0]))
    return rows


@pytest.fixture(autouse=True)
def knobs(monkeypatch):
    global KNOBS
    KNOBS = Knobs()
    hops: list[int] = []
    made = owners_module.call_processor_in_one_hop

    async def recorded(planned, calls, **kwargs):
        hops.append(len(calls))
        return await made(planned, calls, **kwargs)

    monkeypatch.setattr(owners_module, "call_processor_in_one_hop", recorded)
    yield hops
    KNOBS.gate.set()
    KNOBS.release.set()
    KNOBS.slow_release.set()


def batch(q: int, keys: list[int], seq_start: int):
    return vec_batch(q, len(keys), keys=keys, seq_start=seq_start)


@attrs.frozen
class Opened:
    """A routing sink with one stateful "counts" route over ``hop.count``."""

    sink: Any
    q: int  # the bound hook's output id
    out: CaptureSink
    failures: list[RecordFailure]
    route: Route


@contextlib.asynccontextmanager
async def counting_sink(policy: FailurePolicy) -> AsyncIterator[Opened]:
    hooks = HookRegistry()
    q = hooks.bind(Q, layout="vec")
    out = CaptureSink()
    failures: list[RecordFailure] = []
    route = Route("counts", Q, "out", mode="stateful", processor="hop.count", failure_policy=policy)
    async with one_route_sink(route, out, hooks=hooks, on_failure=failures.append) as sink:
        yield Opened(sink, q, out, failures, route)


def counts_by_key(out: CaptureSink) -> dict[int, list[tuple[int, float]]]:
    rows = out.rows("counts")
    return {
        int(k): [
            (int(s), float(n))
            for s, n in zip(
                rows[rows["key"] == k]["seq"], rows[rows["key"] == k]["norm"], strict=True
            )
        ]
        for k in np.unique(rows["key"])
    }


async def test_queued_batches_share_a_hop_that_stops_at_the_first_failure(knobs):
    KNOBS.bad_seqs = {21}  # batch 2's second record
    async with counting_sink(FailurePolicy(deadline=0)) as opened:
        sink, q, out, failures = opened.sink, opened.q, opened.out, opened.failures
        await sink.submit(batch(q, [1], 0))  # its call waits for the gate
        await trio.testing.wait_all_tasks_blocked()
        for i, keys in enumerate([[1, 2], [2, 2], [1, 2], [2]], start=1):
            await sink.submit(batch(q, keys, 10 * i))
        await trio.testing.wait_all_tasks_blocked()
        KNOBS.gate.set()
        await sink.flush()
        counters = sink.counters().routes["counts"]
    assert knobs == [4]  # batches 1-4 in one hop
    # Each good record applied once, in arrival order per key: batch 2's failed
    # call (its first record written before its second raised) was put back,
    # then re-run record by record; batches 3 and 4 ran after it.
    assert counts_by_key(out) == {
        1: [(0, 1.0), (10, 2.0), (30, 3.0)],
        2: [(11, 1.0), (20, 2.0), (31, 3.0), (40, 4.0)],
    }
    assert [f.records.descriptors["seq"].tolist() for f in failures] == [[21]]
    assert failures[0].code is FailureCode.HANDLER_INVALID
    assert counters.processed == 7 and counters.failed == 1


async def test_a_call_in_a_hop_has_the_whole_deadline_from_its_own_start(knobs, mock_clock):
    KNOBS.slow_seq = 10  # batch 1's call takes 3 s
    KNOBS.hang_seq = 20  # batch 2's call hangs (once)
    async with counting_sink(FailurePolicy(deadline=5.0)) as opened:
        sink, q, out, route = opened.sink, opened.q, opened.out, opened.route
        await sink.submit(batch(q, [1], 0))
        await trio.testing.wait_all_tasks_blocked()
        for i, keys in enumerate([[2], [1], [1, 2]], start=1):
            await sink.submit(batch(q, keys, 10 * i))
        await trio.testing.wait_all_tasks_blocked()
        KNOBS.gate.set()  # batches 1-3 go in one hop
        await trio.to_thread.run_sync(KNOBS.slow_started.wait, 10)
        mock_clock.jump(3.0)
        await trio.testing.wait_all_tasks_blocked()
        KNOBS.slow_release.set()
        await trio.to_thread.run_sync(KNOBS.hanging.wait, 10)
        await trio.testing.wait_all_tasks_blocked()
        # 7.9 s into the hop, 4.9 s into the hanging call: not given up yet.
        mock_clock.jump(4.9)
        await trio.testing.wait_all_tasks_blocked()
        assert sink.counters().routes["counts"].failures_by_code == {}
        mock_clock.jump(0.2)  # past the hanging call's own deadline
        await trio.testing.wait_all_tasks_blocked()
        counters = sink.counters().routes["counts"]
        assert counters.failures_by_code == {FailureCode.HANDLER_TIMEOUT.value: 1}
        assert counters.abandoned_calls == 1
        # Batch 3's key-1 record waits behind the timed-out call (its key-2 one flows).
        assert 30 not in out.rows("counts")["seq"].tolist()
        KNOBS.release.set()
        # Its retry after the backoff, then batch 3 behind it (the clock stays
        # put meanwhile: their calls run in real time).
        mock_clock.jump(route.failure_policy.backoff(1))
        await sink.flush()
    seen = counts_by_key(out)
    assert [s for s, _ in seen[1]] == [0, 20, 30]
    assert [s for s, _ in seen[2]] == [10, 31]


async def test_batches_taken_together_keep_their_room_in_the_mailbox_until_done():
    """Taking queued messages at once holds no more than the mailbox would: their
    records stay counted (a sender still waits for room) until done_with."""
    from taproute.actors.mailbox import Mailbox

    mailbox: Mailbox[object] = Mailbox("m", capacity_records=4, capacity_bytes=1 << 20)
    await mailbox.send(("a", None), records=2, nbytes=8)
    await mailbox.send(("b", None), records=2, nbytes=8)
    await mailbox.send("control", records=0, nbytes=0)
    assert await mailbox.receive() == ("a", None)
    taken = mailbox.receive_ready(lambda m: isinstance(m, tuple))
    assert taken == (("b", None), 2, 8)
    assert mailbox.receive_ready(lambda m: isinstance(m, tuple)) is None  # a control: left first
    assert mailbox.records == 2 and mailbox.messages == 1
    sent = trio.Event()

    async def send() -> None:
        await mailbox.send(("c", None), records=3, nbytes=8)
        sent.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send)
        await trio.testing.wait_all_tasks_blocked()
        assert not sent.is_set()  # 2 + 3 records would pass the capacity of 4
        mailbox.done_with(2, 8)
        await sent.wait()
    assert await mailbox.receive() == "control"  # still first in line
    assert await mailbox.receive() == ("c", None)
    assert mailbox.take_all() == [] and mailbox.records == 0


async def test_a_call_given_up_in_its_save_never_runs_in_the_hop(knobs, mock_clock, monkeypatch):
    """The hop's running call passes its deadline while its thread is still
    saving the slots (descheduled, a slow copy): it is given up, and when the
    thread gets on it neither runs the processor (the timed-out record would
    be applied as well as given up) nor makes a further call."""
    from taproute.native import StateRegion

    saves = [0]
    in_save, go = threading.Event(), threading.Event()
    save = StateRegion.save

    def third_save_waits(self, keys, owner):
        saves[0] += 1
        if saves[0] == 3:  # batch 0, then the hop's batch 1, then batch 2
            in_save.set()
            go.wait(10)
        return save(self, keys, owner)

    monkeypatch.setattr(StateRegion, "save", third_save_waits)
    policy = FailurePolicy(deadline=5.0, max_failures=1, failure_window=0)
    async with counting_sink(policy) as opened:
        sink, q, out, failures = opened.sink, opened.q, opened.out, opened.failures
        await sink.submit(batch(q, [1], 0))  # its call waits for the gate
        await trio.testing.wait_all_tasks_blocked()
        released = trio.Event()
        await sink.submit(batch(q, [2], 10))
        second = vec_batch(q, 1, keys=[2], seq_start=20, release=released.set)
        await sink.submit(second)
        second.lease.release()
        await trio.testing.wait_all_tasks_blocked()
        KNOBS.gate.set()  # batches 1 and 2 go in one hop
        await trio.to_thread.run_sync(in_save.wait, 10)
        mock_clock.jump(5.1)  # past batch 2's deadline, in its save
        await trio.testing.wait_all_tasks_blocked()
        assert [f.code for f in failures] == [FailureCode.HANDLER_TIMEOUT]
        go.set()
        await released.wait()  # the hop's thread returned
        await sink.submit(batch(q, [2], 30))
        await sink.flush()
    assert knobs == [2]
    assert counts_by_key(out)[2] == [(10, 1.0), (30, 2.0)]
