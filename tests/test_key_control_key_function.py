"""A key function that raises for a key control's id refuses that control; it
no longer fails the whole router.

A stateful route maps a request key through its key function.  For records,
one that raises fails those records (``policy_invalid``).  For a
``complete``/``cancel``/``reopen`` it raised out of the control and was
latched: ``runtime.complete(999)`` for an id the key function does not know
(a lookup table of live requests, say) failed the runtime, and every later
``submit``/``flush`` raised ``RoutingFailure: record sink complete failed:
KeyError: 999``.  Now such an id is a key that route does not hold: refused
with ``KeyNotHeld`` (naming the key function's error) when no stateful route
holds it, ignored by that route when another does; the router goes on.
"""

from __future__ import annotations

import numpy as np
import pytest

from taproute.actors import open_routing_sink
from taproute.routing import (
    HookRegistry,
    KeyNotHeld,
    Records,
    Route,
    RoutingConfig,
    SlotSpec,
    stateful_processor,
)
from taproute.service import CaptureSink, RoutingSink, create_record_runtime, make_descriptors
from tests.conftest import vec_batch
from tests.processors import SCHEMA, SUM

Q = "layers.0.q"
VEC = SCHEMA.layout_id("vec")
#: Live request ids -> slots: the key function knows no other id.
SLOTS = {100: 0, 200: 1}


def _by_table(descriptors: np.ndarray) -> np.ndarray:
    return np.array([SLOTS[int(key)] for key in descriptors["key"]], dtype=np.int64)


def _count_row(state, key: int) -> np.ndarray:
    row = np.zeros(1, dtype=SUM.dtype)
    row["key"] = key
    row["count"] = int(state.slots[key, 0])
    return row


def _count(records: Records, keys: np.ndarray, state) -> None:
    np.add.at(state.slots[:, 0], keys, 1)


for _name, _key in (("keyfn.table", _by_table), ("keyfn.modulo", lambda d: d["key"] % 1000)):
    stateful_processor(
        _name,
        key=_key,
        key_range=1000 if _name == "keyfn.modulo" else 4,
        slot=SlotSpec((1,), "int64"),
        input="vec",
        output="sum",
        finalize=_count_row,
    )(_count)


def _route(name: str, processor: str) -> Route:
    return Route(name, Q, "out", mode="stateful", processor=processor)


def test_an_id_the_key_function_does_not_know_is_refused_and_the_runtime_goes_on():
    out = CaptureSink()
    sink = RoutingSink(
        RoutingConfig([_route("table", "keyfn.table")]), SCHEMA, {"out": out}, unmatched="drop"
    )
    with create_record_runtime(record_sink=sink) as runtime:
        hook = runtime.bind_hook(Q, layout="vec")
        runtime.submit_batch(
            make_descriptors(hook, 16, count=2, keys=[100, 100], layout_ids=VEC),
            np.ones((2, 4), np.float32),
        )
        with pytest.raises(KeyNotHeld, match=r"999 held by no stateful route.*KeyError\(999\)"):
            runtime.complete(999).result(30)
        runtime.complete(100).result(30)
        runtime.flush()  # raised the latched KeyError before
        snap = runtime.snapshot()
    assert snap.failure is None
    assert snap.ingress.refused_key_controls == 1 and snap.ingress.failed_key_controls == 0
    assert snap.routes["table"].completed_keys == 1
    assert [tuple(r) for b in out.batches for r in b.rows[["key", "count"]].tolist()] == [(0, 2)]
    out.clear()


async def test_an_id_one_route_cannot_map_is_ended_on_the_route_that_holds_it():
    hooks = HookRegistry()
    q = hooks.bind(Q, layout="vec")
    out = CaptureSink()
    config = RoutingConfig([_route("table", "keyfn.table"), _route("modulo", "keyfn.modulo")])
    async with open_routing_sink(
        config, SCHEMA, {"out": out}, unmatched="drop", hooks=hooks
    ) as sink:
        await sink.submit(vec_batch(q, 2, keys=np.array([100, 200])))
        await sink.complete(999, 100)  # 999: only "modulo" holds it; no state there
        await sink.flush()
        snap = sink.snapshot()
    assert snap.failure is None
    assert snap.routes["table"].completed_keys == 1  # 100
    assert snap.routes["modulo"].completed_keys == 2  # 999 (no state: no row) and 100
    rows = sorted(tuple(r) for b in out.batches for r in b.rows[["key", "count"]].tolist())
    assert rows == [(0, 1), (100, 1)]
    out.clear()
