"""Issue #15 (key lifecycle): ``finalize`` runs only for keys that hold state.

A key completed without ever getting a record, a key whose only records were
given up, and a key completed a second time after a reopen with no new record
hold no state: no finalize call, no final row.  A key that processed records
gets exactly one finalize per completion."""

from __future__ import annotations

import threading

import numpy as np

from taproute.routing import (
    FailurePolicy,
    HookRegistry,
    InvalidInput,
    Records,
    Route,
    SlotSpec,
    stateful_processor,
)
from taproute.service import CaptureSink
from tests.conftest import one_route_sink, vec_batch
from tests.processors import SUM

Q = "model.layers.0.attn.q"
KEYS = 8
BAD_KEY = 6  # its records are malformed: given up, never applied

FINALIZED: list[int] = []
LOCK = threading.Lock()


def _final(state, key: int) -> np.ndarray:
    with LOCK:
        FINALIZED.append(key)
    rows = np.zeros(1, dtype=SUM.dtype)
    rows["key"] = key
    rows["count"] = int(state.slots[key, 0])
    return rows


@stateful_processor(
    "test.finalize_counts",
    key=lambda d: d["key"],
    key_range=KEYS,
    slot=SlotSpec((1,), "float64"),
    input="vec",
    output="sum",
    finalize=_final,
)
def counts(records: Records, keys: np.ndarray, state) -> None:
    if (keys == BAD_KEY).any():
        raise InvalidInput("key 6 is malformed")
    np.add.at(state.slots[:, 0], keys, 1)


async def test_finalize_runs_only_for_keys_holding_state():
    FINALIZED.clear()
    hooks = HookRegistry()
    q = hooks.bind(Q, layout="vec")
    out = CaptureSink()
    given_up: list[object] = []
    route = Route(
        "life",
        Q,
        "out",
        mode="stateful",
        processor="test.finalize_counts",
        failure_policy=FailurePolicy(deadline=0),
    )
    async with one_route_sink(route, out, hooks=hooks, on_failure=given_up.append) as sink:
        await sink.submit(vec_batch(q, 3, keys=np.array([1, 1, BAD_KEY])))
        await sink.complete(1, 2, BAD_KEY)  # 2 never got a record; 6's was given up
        await sink.flush()
        assert FINALIZED == [1]
        await sink.reopen(1)
        await sink.complete(1)  # reopened, but no record since: no state
        await sink.flush()
        counters = sink.counters().routes["life"]
    assert FINALIZED == [1]
    rows = np.concatenate([b.rows for b in out.batches])
    assert rows["key"].tolist() == [1] and rows["count"].tolist() == [2]
    assert len(given_up) == 1
    assert counters.completed_keys == 4 and counters.finalize_rows == 1
