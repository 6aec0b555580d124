"""Parked records and their dead letters name the hook their records came from.

Two ways they did not: a routing sink given ``on_failure=parking.handle``
(the README's park store set-up) never named hooks to the store, so every
letter read ``#<output_id>`` and no route took its reroute; and the park
store kept each record's output_id alone, which a restart that bound its
hooks in another order read as another hook's.  The park store now names
hooks from the sink's registry, keeps each parked record's hook name, and
a restart maps it to the id the name has there.
"""

from __future__ import annotations

import pytest

from taproute.actors import open_routing_sink
from taproute.routing import FailurePolicy, HookRegistry, Route, RoutingConfig
from taproute.service import CaptureSink
from taproute.service.ops.parking import ParkedRecordStore
from tests.conftest import vec_batch
from tests.failing_processors import SCRIPT
from tests.processors import SCHEMA

Q = "layers.0.q"
#: Retried once, then given up: the first failure parks, the second gives up.
TWICE = FailurePolicy(deadline=0, initial_backoff=1, max_failures=2, failure_window=0)


@pytest.fixture(autouse=True)
def fresh_script():
    SCRIPT.reset()
    yield
    SCRIPT.release_hang.set()


def _sink(hooks: HookRegistry, parking: ParkedRecordStore, policy: FailurePolicy):
    route = Route(
        "r", Q, "out", mode="stateless", processor="fail.always_transient", failure_policy=policy
    )
    return open_routing_sink(
        RoutingConfig([route]),
        SCHEMA,
        {"out": CaptureSink()},
        unmatched="drop",
        hooks=hooks,
        on_failure=parking.handle,
        park=parking,
    )


async def test_letters_given_up_through_the_park_store_name_their_hook(autojump_clock, parking):
    hooks = HookRegistry()
    q = hooks.bind(Q, layout="vec")
    async with _sink(hooks, parking, TWICE) as sink:
        await sink.submit(vec_batch(q, 2))
        await sink.flush(wait=True)
    assert [letter.hook for letter in parking.dead_letters.list()] == [Q, Q]


async def test_a_restart_that_binds_hooks_in_another_order_keeps_parked_records_hooks(
    autojump_clock, parking
):
    first = HookRegistry()
    first.bind("layers.0.k", layout="vec")
    q = first.bind(Q, layout="vec")  # output_id 1 in the first run
    async with _sink(first, parking, TWICE) as sink:
        await sink.submit(vec_batch(q, 3))
        assert (await sink.flush()).routes["r"].parked == 3  # left parked at close
    assert parking.count() == 3

    second = HookRegistry()
    assert second.bind(Q, layout="vec") == 0
    assert second.bind("layers.0.k", layout="vec") == 1  # the id Q had
    async with _sink(second, parking, TWICE) as sink:
        report = await sink.flush(wait=True)  # restored, retried, given up
    assert report.routes["r"].restored == 3 and report.routes["r"].dead_lettered == 3
    assert [letter.hook for letter in parking.dead_letters.list()] == [Q, Q, Q]
