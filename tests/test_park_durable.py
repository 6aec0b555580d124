"""Retry parking is durable (issue #12): records parked for a retry, or waiting
behind a failing record of their key, are in the park store (the dead-letter
file's ``parked`` table) from the moment the message that parked them is
done; a retried record leaves it only once its output was flushed to the
destination; a restart takes back what a run left, in order per key; and
what ``flush()`` returns matches where the records really are."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager

import numpy as np
import pytest
import trio
import trio.testing

from taproute.actors import RoutingSink, open_routing_sink
from taproute.routing import FailurePolicy, HookRegistry, Route, RoutingConfig
from taproute.routing.flush_report import RouteAccount
from taproute.routing.sink import RecordSink
from taproute.service import CaptureSink
from taproute.service.ops.parking import ParkedRecordStore
from tests.conftest import vec_batch
from tests.failing_processors import SCRIPT
from tests.processors import SCHEMA

Q = "layers.0.q"
NO_DEADLINE = FailurePolicy(deadline=0)  # a mock clock would otherwise jump past it


@pytest.fixture(autouse=True)
def fresh_script():
    SCRIPT.reset()
    yield
    SCRIPT.release_hang.set()


def hooks_with_q() -> tuple[HookRegistry, int]:
    hooks = HookRegistry()
    return hooks, hooks.bind(Q, layout="vec")


class GatedFlushSink(CaptureSink):
    """A destination whose flush waits for ``gate`` (to look inside a flush)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = trio.Event()
        self.flushing = trio.Event()

    async def flush(self) -> None:
        self.flushing.set()
        await self.gate.wait()
        await super().flush()


def stateless(processor: str, policy: FailurePolicy = NO_DEADLINE) -> RoutingConfig:
    return RoutingConfig(
        [Route("r", Q, "out", mode="stateless", processor=processor, failure_policy=policy)]
    )


def parked(
    config: RoutingConfig, out: RecordSink, hooks: HookRegistry, parking: ParkedRecordStore
) -> AbstractAsyncContextManager[RoutingSink]:
    """A routing sink of ``config`` into ``out`` (unmatched records dropped),
    its failed records parked in ``parking``."""
    return open_routing_sink(
        config,
        SCHEMA,
        {"out": out},
        unmatched="drop",
        hooks=hooks,
        on_failure=parking.handle,
        park=parking,
    )


def keyed(policy: FailurePolicy = NO_DEADLINE) -> RoutingConfig:
    route = Route(
        "keyed",
        Q,
        "out",
        mode="stateful",
        processor="fail.keyed_log",
        workers=2,
        failure_policy=policy,
    )
    return RoutingConfig([route])


async def test_park_persist_retry_deliver_then_forget_after_the_flush(mock_clock, parking):
    SCRIPT.failures_left[-1] = 1  # fail.transient_then_ok: the first call fails
    hooks, q = hooks_with_q()
    out = GatedFlushSink()
    out.gate.set()
    async with parked(stateless("fail.transient_then_ok"), out, hooks, parking) as sink:
        await sink.submit(vec_batch(q, 4))
        report = await sink.flush()
        # Parked, and durable: the store has them before flush() returned.
        assert report.parked_durable
        assert report.routes["r"] == RouteAccount(
            accepted=4, delivered=0, dead_lettered=0, dropped=0, parked=4
        )
        assert parking.count("r") == 4
        out.gate = trio.Event()
        out.flushing = trio.Event()
        mock_clock.jump(2)  # the backoff: retried, and it works now
        await out.flushing.wait()  # the destination flushes the retried rows...
        # ...processed and handed to the destination, whose flush has not
        # returned: the records are still in the park store.
        assert sink.counters().routes["r"].processed == 4
        assert parking.count("r") == 4
        out.gate.set()
        report = await sink.flush()
        assert parking.count("r") == 0  # forgotten once the destination flushed
    assert report.routes["r"] == RouteAccount(
        accepted=4, delivered=4, dead_lettered=0, dropped=0, parked=0
    )
    assert out.rows("r")["seq"].tolist() == [0, 1, 2, 3]


async def test_a_restart_retries_parked_records_in_key_order_and_counts_each_once(
    mock_clock, parking
):
    SCRIPT.failures_left[3] = 100  # key 3 fails for the whole first run
    hooks, q = hooks_with_q()
    keys = [3, 1, 3, 2, 1, 3, 2]
    first = CaptureSink()
    async with parked(keyed(), first, hooks, parking) as sink:
        for seq, key in enumerate(keys):
            await sink.submit(vec_batch(q, 1, keys=[key], seq_start=seq))
        report = await sink.flush()
        # The failing key-3 record and the two behind it: parked, durably.
        assert report.routes["keyed"] == RouteAccount(
            accepted=7, delivered=4, dead_lettered=0, dropped=0, parked=3
        )
        assert parking.count("keyed") == 3
    # Closed with a park store: nothing given up, the three stay for the next start.
    assert parking.count("keyed") == 3
    assert SCRIPT.log == [(1, 1), (2, 3), (1, 4), (2, 6)]

    SCRIPT.failures_left[3] = 0  # healed
    second = CaptureSink()
    hooks2, _ = hooks_with_q()
    async with parked(keyed(), second, hooks2, parking) as sink:
        report = await sink.flush(wait=True)
    assert report.routes["keyed"] == RouteAccount(
        accepted=3, delivered=3, dead_lettered=0, dropped=0, parked=0, restored=3
    )
    assert report.waited and report.fully_delivered
    # Key 3's records, in arrival order, exactly once over both runs.
    assert [entry for entry in SCRIPT.log if entry[0] == 3] == [(3, 0), (3, 2), (3, 5)]
    seqs = np.concatenate([first.rows("keyed")["seq"], second.rows("keyed")["seq"]])
    assert sorted(seqs.tolist()) == list(range(7))
    assert parking.count() == 0


async def test_a_give_up_moves_parked_records_to_the_dead_letters_in_one_step(
    autojump_clock, parking
):
    hooks, q = hooks_with_q()
    policy = FailurePolicy(deadline=0, initial_backoff=1, max_failures=2, failure_window=0)
    config = stateless("fail.always_transient", policy)
    async with parked(config, CaptureSink(), hooks, parking) as sink:
        await sink.submit(vec_batch(q, 3, seq_start=10))
        assert (await sink.flush()).routes["r"].parked == 3
        assert parking.count() == 3
        # Retried once more, then each record tried once on its own (its last
        # try: the failure could have been one record's), then given up.
        report = await sink.flush(wait=True)
    assert report.routes["r"] == RouteAccount(
        accepted=3, delivered=0, dead_lettered=3, dropped=0, parked=0
    )
    letters = parking.dead_letters.list()
    assert [letter.seq for letter in letters] == [10, 11, 12]
    assert {letter.attempts for letter in letters} == {3}  # the batch's 2, its own 1
    assert parking.count() == 0  # in exactly one place


async def test_a_running_sink_keeps_its_parked_records_from_a_second_sink(mock_clock, parking):
    """A reload builds the next routing sink beside the running one: it must not
    take the running one's parked records."""
    SCRIPT.failures_left[-1] = 1
    hooks, q = hooks_with_q()
    async with parked(stateless("fail.transient_then_ok"), CaptureSink(), hooks, parking) as sink:
        await sink.submit(vec_batch(q, 2))
        await sink.flush()
        assert parking.count() == 2
        hooks2, _ = hooks_with_q()
        config = stateless("fail.transient_then_ok")
        async with parked(config, CaptureSink(), hooks2, parking) as beside:
            assert (await beside.flush()).routes["r"].restored == 0
        mock_clock.jump(2)
        await trio.testing.wait_all_tasks_blocked()
        report = await sink.flush()
    assert report.routes["r"].delivered == 2 and parking.count() == 0


async def test_flush_report_matches_the_destination_the_letters_and_the_store(mock_clock, parking):
    """Every state at once on a stateful route: delivered, dead-lettered,
    dropped (a terminal record, a cancel), parked; the report agrees with the
    destination's rows, the dead-letter store and the park store."""
    SCRIPT.failures_left.update({3: 100, 6: 100})  # keys 3 and 6 keep failing
    hooks, q = hooks_with_q()
    out = CaptureSink()
    sink = RoutingSink(
        keyed(FailurePolicy(deadline=0, terminal_records="drop")),
        SCHEMA,
        {"out": out},
        unmatched="drop",
        hooks=hooks,
        on_failure=parking.handle,
        park=parking,
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        for seq, key in enumerate([3, 1, 3, 2, 4, 4]):
            await sink.submit(vec_batch(q, 1, keys=[key], seq_start=seq))
        await sink.complete(1)
        await sink.submit(vec_batch(q, 1, keys=[1], seq_start=6))  # terminal: dropped
        await sink.submit(vec_batch(q, 2, keys=[5, 5], seq_start=7))
        await sink.submit(vec_batch(q, 1, keys=[99], seq_start=9))  # outside K: dead letter
        await sink.submit(vec_batch(q, 1, keys=[6], seq_start=10))  # parked
        middle = await sink.flush()
        assert middle.routes["keyed"].parked == parking.count("keyed") == 3
        await sink.cancel(3)  # key 3's parked record and the one behind it: discarded
        report = await sink.flush()
        await sink.close()
    account = report.routes["keyed"]
    assert sorted(out.rows("keyed")["seq"].tolist()) == [1, 3, 4, 5, 7, 8]
    assert [letter.seq for letter in parking.dead_letters.list()] == [9]
    assert account == RouteAccount(
        accepted=11, delivered=6, dead_lettered=1, dropped=1 + 2, parked=1
    )
    assert account.settled and report.parked == 1 and not report.fully_delivered
    assert parking.count("keyed") == 1  # key 6's record: still parked after close
