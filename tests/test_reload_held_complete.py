"""A complete waiting behind a failing key still takes effect when a reload
gives the route another processor.

A stateful route's key control queued behind the key's held records (a
complete must not overtake them) was handed over with them.  When the next
generation could not take them over (another processor: they fail
``handler_missing``), the records were dead-lettered and the complete was
dropped: no ``finalize`` row for what the key had processed, no
``completed_keys``.  Now what waited behind them is applied as at a close:
once the records before it are given up, the complete finalizes the key
with the state it had under the processor that built it.
"""

from __future__ import annotations

import numpy as np

from taproute.actors import open_routing_sink
from taproute.routing import (
    Failed,
    FailurePolicy,
    HookRegistry,
    RecordFailure,
    Records,
    Route,
    RoutingConfig,
    SlotSpec,
    stateful_processor,
)
from taproute.service import CaptureSink
from tests.conftest import vec_batch
from tests.processors import SCHEMA, SUM

Q = "layers.0.q"
KEY = 3
#: Key -> calls still to fail (transiently).
FAILURES: dict[int, int] = {}
#: Retries far in the future: the frozen clock never gets there.
SLOW_RETRY = FailurePolicy(deadline=0, initial_backoff=1000.0, max_backoff=1000.0)


def _count_row(state, key: int) -> np.ndarray:
    row = np.zeros(1, dtype=SUM.dtype)
    row["key"] = key
    row["count"] = int(state.slots[key, 0])
    return row


def _count(records: Records, keys: np.ndarray, state) -> Failed | None:
    for key in set(keys.tolist()):
        if FAILURES.get(key, 0) > 0:
            FAILURES[key] -= 1
            return Failed(f"key {key} not ready")
    np.add.at(state.slots[:, 0], keys, 1)
    return None


for _name in ("held.count_v1", "held.count_v2"):
    stateful_processor(
        _name,
        key=lambda d: d["key"],
        key_range=16,
        slot=SlotSpec((1,), "int64"),
        input="vec",
        output="sum",
        finalize=_count_row,
    )(_count)


def _config(processor: str) -> RoutingConfig:
    return RoutingConfig(
        [
            Route(
                "s",
                Q,
                "out",
                mode="stateful",
                processor=processor,
                workers=2,
                failure_policy=SLOW_RETRY,
            )
        ]
    )


async def test_a_complete_behind_records_a_reload_gives_up_finalizes_the_key(mock_clock):
    FAILURES.clear()
    hooks = HookRegistry()
    q = hooks.bind(Q, layout="vec")
    out = CaptureSink()
    failures: list[RecordFailure] = []
    async with open_routing_sink(
        _config("held.count_v1"),
        SCHEMA,
        {"out": out},
        unmatched="drop",
        hooks=hooks,
        on_failure=failures.append,
    ) as sink:
        await sink.submit(vec_batch(q, 1, keys=np.array([KEY]), seq_start=0))  # applied
        await sink.flush()
        FAILURES[KEY] = 1
        for seq in (1, 2):  # 1 fails and is parked, 2 waits behind it
            await sink.submit(vec_batch(q, 1, keys=np.array([KEY]), seq_start=seq))
        await sink.complete(KEY)  # waits behind them
        await sink.flush()
        assert sink.snapshot().routes["s"].parked == 2
        await sink.reload(_config("held.count_v2"))
        report = await sink.flush()
        counters = sink.snapshot().routes["s"]
    assert sorted(f.code.value for f in failures) == ["handler_missing", "handler_missing"]
    assert report.routes["s"].dead_lettered == 2 and report.routes["s"].delivered == 1
    # The complete took effect once they were given up: the key's final row
    # holds what it processed (seq 0), and it counts as completed.
    (rows,) = [b.rows for b in out.batches]
    assert rows[["key", "count"]].tolist() == [(KEY, 1)]
    assert counters.completed_keys == 1 and counters.finalize_rows == 1
    out.clear()
