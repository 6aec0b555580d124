"""A stateful processor's ``finalize`` that never returns no longer holds its
route for ever.

``finalize`` ran in a worker thread with no deadline and without
``abandon_on_cancel``: a hung one held the key owner (every other key of it
waited, so ``flush()`` never returned), and a close whose shutdown grace ran
out could not cut it off (``ShutdownAbandoned`` with the loop thread still
blocked).  Now it runs under the route's deadline, as the processor does:
past it, it is abandoned and counted in ``finalize_failures``, the slot is
cleared, and the owner goes on; without a deadline the grace cuts it off and
the loop ends.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import trio

from taproute.native import make_descriptors
from taproute.routing import (
    FailurePolicy,
    HookRegistry,
    Records,
    Route,
    RoutingConfig,
    ShutdownAbandoned,
    SlotSpec,
    stateful_processor,
)
from taproute.service import CaptureSink, RoutingSink, create_record_runtime
from tests.conftest import one_route_sink, vec_batch
from tests.processors import SCHEMA, SUM

Q = "layers.0.q"
HUNG = 1  # this key's finalize waits for RELEASE
RELEASE = threading.Event()


def _final(state, key: int) -> np.ndarray:
    if key == HUNG:
        RELEASE.wait(120)
    row = np.zeros(1, dtype=SUM.dtype)
    row["key"] = key
    row["count"] = int(state.slots[key, 0])
    return row


@stateful_processor(
    "test.hung_finalize",
    key=lambda d: d["key"],
    key_range=8,
    slot=SlotSpec((1,), "int64"),
    input="vec",
    output="sum",
    finalize=_final,
)
def count(records: Records, keys: np.ndarray, state) -> None:
    np.add.at(state.slots[:, 0], keys, 1)


@pytest.fixture(autouse=True)
def release_at_end():
    RELEASE.clear()
    yield
    RELEASE.set()


def _route(deadline: float) -> Route:
    return Route(
        "s",
        Q,
        "out",
        mode="stateful",
        processor="test.hung_finalize",
        workers=1,  # one owner: the hung key and the next share it
        failure_policy=FailurePolicy(deadline=deadline),
    )


async def test_a_finalize_past_the_deadline_is_abandoned_and_the_owner_goes_on():
    hooks = HookRegistry()
    q = hooks.bind(Q, layout="vec")
    out = CaptureSink()
    async with one_route_sink(_route(1.0), out, hooks=hooks) as sink:
        with trio.fail_after(60):  # a hang guard only: it used to wait for ever here
            await sink.submit(vec_batch(q, 3, keys=np.array([HUNG, 2, 2])))
            await sink.complete(HUNG)
            await sink.complete(2)  # same owner, behind the hung finalize
            await sink.flush()
        counters = sink.snapshot().routes["s"]
    assert counters.finalize_failures == 1
    assert counters.completed_keys == 2 and counters.finalize_rows == 1
    assert counters.valid_slots == 0 and counters.open_keys == 0
    (rows,) = [b.rows for b in out.batches]
    assert rows["key"].tolist() == [2] and rows["count"].tolist() == [2]
    out.clear()


def test_without_a_deadline_the_shutdown_grace_cuts_a_hung_finalize_off():
    sink = RoutingSink(RoutingConfig([_route(0)]), SCHEMA, {"out": CaptureSink()}, unmatched="drop")
    runtime = create_record_runtime(record_sink=sink, shutdown_grace=0.5)
    hook = runtime.bind_hook(Q, layout="vec")
    runtime.submit_batch(
        make_descriptors(hook, 16, count=1, keys=[HUNG], layout_ids=SCHEMA.layout_id("vec")),
        np.ones((1, 4), np.float32),
    )
    runtime.complete(HUNG).result(10)
    started = time.monotonic()
    with pytest.raises(ShutdownAbandoned) as raised:
        runtime.close()
    # The loop thread ended: the finalize's thread was abandoned, not waited for.
    assert raised.value.loop_ended
    assert time.monotonic() - started < 0.5 + 1.5
