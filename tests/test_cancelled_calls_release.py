"""A processor call cancelled before its worker thread started gives the
batch's buffer back.

The calls hold the batch's buffer for their thread (which may outlive the
call when it is abandoned) and let go when the thread returns.  A call
cancelled after taking that hold but before its thread got a slot (a
shutdown's grace cancelling a worker that had just received a batch) never
started a thread, so nothing ever let go: the producer's release callback
never ran.  Seen as one release in three runs missing after a close cut off
by its grace while a reload retired a stateless route.
"""

from __future__ import annotations

import math

import trio

from taproute.actors.attempt import Placement, call_processor
from taproute.actors.one_hop import Call, call_processor_in_one_hop
from taproute.routing import REGISTRY, Route, RoutingConfig
from taproute.routing.plan import RoutePlan
from tests.conftest import vec_batch
from tests.processors import SCHEMA


class _CancelledOnEntry:
    """A route limiter whose slot is granted just as a cancel arrives (the
    grace's cancel landing in the checkpoint after the slot was taken)."""

    def __init__(self, scope: trio.CancelScope) -> None:
        self.scope = scope

    async def __aenter__(self) -> None:
        self.scope.cancel()

    async def __aexit__(self, *exc: object) -> None:
        return None


def _planned(processor: str, mode: str = "stateless"):
    route = Route("r", "q", "d", mode=mode, processor=processor)
    plan = RoutePlan(
        RoutingConfig([route]), SCHEMA, destinations=["d"], unmatched="drop", registry=REGISTRY
    )
    return plan.routes[0]


async def test_a_thread_call_cancelled_before_its_thread_started_lets_the_buffer_go():
    released: list[int] = []
    batch = vec_batch(0, 4, release=lambda: released.append(1))
    planned = _planned("test.rendezvous")  # needs_thread: always a worker thread
    with trio.CancelScope() as scope:
        await call_processor(
            planned,
            batch,
            limiter=_CancelledOnEntry(scope),  # type: ignore[arg-type]
            threads=trio.CapacityLimiter(math.inf),  # its thread never gets a slot
        )
    assert scope.cancelled_caught
    batch.lease.release()  # the producer's own hold, as the route's settle does
    assert released == [1]


async def test_a_hop_cancelled_before_its_thread_started_lets_the_buffers_go():
    released: list[int] = []
    batches = [vec_batch(0, 2, release=lambda: released.append(1)) for _ in range(3)]
    planned = _planned("test.running_sum", mode="stateful")
    with trio.CancelScope() as scope:
        scope.cancel()
        await call_processor_in_one_hop(
            planned,
            [Call(b, ()) for b in batches],
            limiter=trio.CapacityLimiter(1),
            threads=trio.CapacityLimiter(math.inf),
            placement=Placement(),
        )
    assert scope.cancelled_caught
    for b in batches:
        b.lease.release()
    assert released == [1, 1, 1]
