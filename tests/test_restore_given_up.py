"""Records restored from the park store that an unexpected failure cuts short
are counted given up, once, and stay parked for the next start.

At start a routing sink hands each route what a previous run left parked
(``restore``): the route counts the records accepted (and restored), then
queues them for its workers or key owners.  When queueing raised, the
exception left ``restore`` with the records counted accepted and nothing
else (neither processed, dead-lettered, given up nor parked: ``accepted``
no longer added up), and it ended the sink's start.  Now the route counts
what it had not handed on as ``given_up`` and latches the failure naming
itself and the restore, as its dispatch of new records does; the sink
starts, every later call raises that failure, and the records stay in the
park store for the next start.

How the failure is caused: no real input makes queueing a restored record
raise (the mailboxes are open while the sink starts), so the tests inject
it: the route's ``_enqueue`` is monkeypatched to raise while the sink
starts, standing for any internal invariant a future bug breaks.
"""

from __future__ import annotations

import pytest

from taproute.actors.owners import StatefulRoute
from taproute.actors.pool import StatelessRoute
from taproute.routing.errors import RoutingFailure
from taproute.service import CaptureSink
from tests.conftest import vec_batch
from tests.failing_processors import SCRIPT
from tests.processors import KEY_RANGE
from tests.test_park_durable import hooks_with_q, keyed, parked, stateless


class InvariantBroken(RuntimeError):
    """What the injected fault raises."""


@pytest.fixture(autouse=True)
def fresh_script():
    SCRIPT.reset()
    yield
    SCRIPT.release_hang.set()


def _adds_up(r) -> bool:
    return r.accepted == r.processed + r.failed + r.dropped + r.given_up + r.parked


def _failing_enqueue(monkeypatch, cls, *, let_through: int) -> list[int]:
    """While armed (the list holds True), ``cls._enqueue`` lets ``let_through``
    calls go on, then raises; returns the arming list."""
    armed: list[int] = []
    calls = [0]
    real = cls._enqueue

    async def enqueue(self, mailbox, message, batch, *, wait=True):
        if armed:
            calls[0] += 1
            if calls[0] > let_through:
                raise InvariantBroken("queueing restored records broke an invariant")
        await real(self, mailbox, message, batch, wait=wait)

    monkeypatch.setattr(cls, "_enqueue", enqueue)
    return armed


async def test_a_stateless_restore_cut_short_counts_its_records_given_up_once(
    mock_clock, parking, monkeypatch
):
    SCRIPT.failures_left[-1] = 100  # fail.transient_then_ok: fails for the whole first run
    hooks, q = hooks_with_q()
    config = stateless("fail.transient_then_ok")
    async with parked(config, CaptureSink(), hooks, parking) as sink:
        await sink.submit(vec_batch(q, 3))
        assert (await sink.flush()).routes["r"].parked == 3
    assert parking.count("r") == 3  # left for the next start

    SCRIPT.failures_left[-1] = 0
    armed = _failing_enqueue(monkeypatch, StatelessRoute, let_through=0)
    armed.append(True)
    hooks2, _ = hooks_with_q()
    # Before: the restore's exception ended the start here.
    with pytest.raises(RoutingFailure, match="route 'r', restoring parked records"):
        async with parked(config, CaptureSink(), hooks2, parking) as sink:
            armed.clear()
            with pytest.raises(RoutingFailure, match="restoring parked records") as raised:
                await sink.flush()
            assert isinstance(raised.value.cause, InvariantBroken)
    r = sink.counters().routes["r"]
    assert (r.accepted, r.restored, r.processed, r.given_up) == (3, 3, 0, 3)
    assert _adds_up(r)
    assert parking.count("r") == 3  # still parked, for the next start


async def test_a_stateful_restore_cut_short_counts_what_it_did_not_hand_on_given_up(
    mock_clock, parking, monkeypatch
):
    low, high = 1, KEY_RANGE - 1  # of two owners: one key each
    SCRIPT.failures_left.update({low: 100, high: 100})  # fail for the whole first run
    hooks, q = hooks_with_q()
    async with parked(keyed(), CaptureSink(), hooks, parking) as sink:
        for seq, key in enumerate([low, high, low, high]):
            await sink.submit(vec_batch(q, 1, keys=[key], seq_start=seq))
        assert (await sink.flush()).routes["keyed"].parked == 4
    assert parking.count("keyed") == 4

    SCRIPT.failures_left.clear()
    armed = _failing_enqueue(monkeypatch, StatefulRoute, let_through=1)
    armed.append(True)
    hooks2, _ = hooks_with_q()
    out = CaptureSink()
    with pytest.raises(RoutingFailure, match="route 'keyed', restoring parked records"):
        async with parked(keyed(), out, hooks2, parking) as sink:
            armed.clear()
            with pytest.raises(RoutingFailure, match="restoring parked records"):
                await sink.flush()
    # Closing drained what was handed on: processed by its owner.
    r = sink.counters().routes["keyed"]
    assert (r.accepted, r.restored) == (4, 4)
    handed_on = sum(len(b.rows) for b in out.row_batches("keyed"))
    assert 0 < handed_on < 4  # the first part went to its owner, the rest was cut short
    assert (r.processed, r.given_up) == (handed_on, 4 - handed_on)
    assert _adds_up(r)
