"""Retries on a stateful route inside a runtime, whose producers take their
buffers back once the records are handed on.

The fault: a stateful owner let go of a parked key's hold on its buffer
before it retried the key.  Inside a runtime that hold was the last one
(the record worker's and the owner's message's were given back when the
records were parked), so the buffer went back to its producer, and the
retry's call could not take a lease on it: ``LeaseError: cannot acquire a
lease on a buffer that was already released``, latched as the stateful
owner's failure (the next flush raised it), the records never delivered.
Tests that submit to a routing sink directly never give their buffers back,
so they never saw it.  Now the buffer is held while the retry runs and let
go after.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from taproute.native import make_descriptors
from taproute.routing import (
    Failed,
    FailurePolicy,
    Records,
    Route,
    RoutingConfig,
    SlotSpec,
    stateful_processor,
)
from taproute.service import RoutingSink, create_record_runtime
from tests.processors import NORM, SCHEMA
from tests.sinks import NullSink

VEC = SCHEMA.layout_id("vec")
#: Calls still to fail (retryably), and the seqs applied to the state, in order.
FAILS = {"left": 0}
APPLIED: list[int] = []
_lock = threading.Lock()


@stateful_processor(
    "runtime_retries.keyed",
    key=lambda d: d["key"],
    key_range=4,
    slot=SlotSpec((1,), "int64"),
    input="vec",
    output="norm",
)
def keyed(records: Records, keys: np.ndarray, state):
    seqs = records.descriptors["seq"].tolist()
    with _lock:
        if FAILS["left"]:
            FAILS["left"] -= 1
            return Failed("feature store restarting")
        APPLIED.extend(seqs)
    np.add.at(state.slots[:, 0], keys, 1)
    rows = np.zeros(len(keys), dtype=NORM.dtype)
    rows["key"] = keys
    rows["seq"] = seqs
    return rows


@pytest.fixture(autouse=True)
def _reset():
    FAILS["left"] = 0
    APPLIED.clear()


def test_a_stateful_key_retried_in_a_runtime_is_delivered():
    FAILS["left"] = 2
    # Retries come back at once (no backoff to wait for in real time).
    policy = FailurePolicy(deadline=600.0, initial_backoff=0, max_failures=5, failure_window=0)
    route = Route(
        "r", "h.*", "ok", mode="stateful", processor="runtime_retries.keyed", failure_policy=policy
    )
    ok = NullSink()
    sink = RoutingSink(RoutingConfig([route]), SCHEMA, {"ok": ok}, unmatched="drop")
    released: list[int] = []
    with create_record_runtime(record_sink=sink, name="taproute-runtime-retries") as runtime:
        hook = runtime.bind_hook("h.0", layout="vec")
        runtime.submit_batch(
            make_descriptors(
                hook, 16, count=4, layout_ids=VEC, keys=np.array([1, 2, 1, 2]), seqs=np.arange(4)
            ),
            np.zeros((4, 4), np.float32),
            release=lambda: released.append(1),
        )
        report = runtime.flush(wait=True)  # before: raised the latched LeaseError
        r = runtime.snapshot().routes["r"]
        assert released == [1]  # given back once, after the retries read it
    assert report is not None and report.fully_delivered
    assert (r.accepted, r.processed, r.failed, r.parked, r.given_up) == (4, 4, 0, 0, 0)
    assert r.retries >= 2 and r.recovered == 4
    assert sorted(APPLIED) == [0, 1, 2, 3]  # each record applied once
    assert ok.records == 4
