"""Processors the replay tests run, registered on import (workers import this
module by name, as a user's worker imports theirs)."""

from __future__ import annotations

import numpy as np

from taproute.routing import Failed, Records, SlotSpec, stateful_processor, stateless_processor
from taproute.service.replay import ProcessResult, batch_processor
from tests.processors import KEY_RANGE, NORM, SUM


def _sum_rows(state, keys: np.ndarray) -> np.ndarray:
    rows = np.empty(len(keys), dtype=SUM.dtype)
    rows["key"] = keys
    rows["total"] = state.slots[keys, :4]
    rows["count"] = state.slots[keys, 4]
    return rows


def _merge_sums(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return a + b


@stateful_processor(
    "replay.running_sum",
    key=lambda d: d["key"] % KEY_RANGE,
    key_range=KEY_RANGE,
    slot=SlotSpec((5,), "float64"),
    input="vec",
    output="sum",
    merge=_merge_sums,
    finish=_sum_rows,
)
def running_sum(records: Records, keys: np.ndarray, state) -> np.ndarray:
    """Per key: running total of the vectors and count; one row per record."""
    values = records.rows()["values"].astype(np.float64)
    np.add.at(state.slots[:, :4], keys, values)
    np.add.at(state.slots[:, 4], keys, 1)
    return _sum_rows(state, keys)


#: Keys whose records make ``replay.sum_fails_on_key`` raise (tests set and clear it).
STATEFUL_POISON_KEYS: set[int] = set()


@stateful_processor(
    "replay.sum_fails_on_key",
    key=lambda d: d["key"] % KEY_RANGE,
    key_range=KEY_RANGE,
    slot=SlotSpec((5,), "float64"),
    input="vec",
    output="sum",
)
def sum_fails_on_key(records: Records, keys: np.ndarray, state) -> np.ndarray:
    """``replay.running_sum``, raising on a unit holding a key of STATEFUL_POISON_KEYS."""
    poisoned = set(records.descriptors["key"].tolist()) & STATEFUL_POISON_KEYS
    if poisoned:
        raise ValueError(f"cannot handle key(s) {sorted(poisoned)}")
    return running_sum(records, keys, state)


#: Keys whose records make ``replay.fails_on_key`` raise.
POISON_KEYS = {13}
#: Calls of ``replay.flaky`` so far (it fails its first call).
FLAKY_CALLS = [0]


@stateless_processor("replay.fails_on_key", input="vec", output="norm")
def fails_on_key(records: Records) -> np.ndarray:
    keys = set(records.descriptors["key"].tolist())
    if keys & POISON_KEYS:
        raise ValueError(f"cannot handle key(s) {sorted(keys & POISON_KEYS)}")
    rows = np.zeros(len(records), dtype=NORM.dtype)
    rows["key"] = records.descriptors["key"]
    return rows


@stateless_processor("replay.flaky", input="vec", output="norm")
def flaky(records: Records) -> np.ndarray | Failed:
    FLAKY_CALLS[0] += 1
    if FLAKY_CALLS[0] == 1:
        return Failed("dependency restarting")
    rows = np.zeros(len(records), dtype=NORM.dtype)
    rows["key"] = records.descriptors["key"]
    rows["seq"] = records.descriptors["seq"]
    return rows


INIT_CALLS: list[dict] = []


def _init(*, ctx, params, resume) -> dict:
    INIT_CALLS.append({"run_id": ctx.run_id, "params": dict(params), "resume": resume})
    return {"scale": float(params.get("scale", 1.0))}


@batch_processor(
    "replay.batch_norms", input="vec", outputs={"norms": "norm", "sums": "sum"}, init=_init
)
def batch_norms(batch, *, ctx, params, processor_ctx) -> list[ProcessResult]:
    """Norms scaled by processor_ctx["scale"] on one lane, per-key sums on another."""
    records = batch.records
    values = records.rows()["values"].astype(np.float64)
    norms = np.empty(len(records), dtype=NORM.dtype)
    norms["key"] = records.descriptors["key"]
    norms["seq"] = records.descriptors["seq"]
    norms["norm"] = np.linalg.norm(values, axis=1) * processor_ctx["scale"]
    keys, inverse = np.unique(records.descriptors["key"], return_inverse=True)
    sums = np.zeros(len(keys), dtype=SUM.dtype)
    sums["key"] = keys
    np.add.at(sums["total"], inverse, values)
    np.add.at(sums["count"], inverse, 1)
    return [
        ProcessResult(
            rows={"norms": norms}, stats={"records": len(records)}, unit_id=batch.unit_id
        ),
        ProcessResult(rows={"sums": sums}, stats={"keys": len(keys)}, unit_id=batch.unit_id),
    ]


@stateless_processor("replay.dies_in_a_worker", input="vec", output="norm")
def dies_in_a_worker(records: Records) -> np.ndarray:
    """Kills its own process (SIGKILL) on key 21, unless it runs in the driver
    (whose pid the test puts in TAPROUTE_TEST_DRIVER_PID)."""
    import os
    import signal

    if 21 in records.descriptors["key"] and os.getpid() != int(
        os.environ["TAPROUTE_TEST_DRIVER_PID"]
    ):
        os.kill(os.getpid(), signal.SIGKILL)
    rows = np.zeros(len(records), dtype=NORM.dtype)
    rows["key"] = records.descriptors["key"]
    rows["seq"] = records.descriptors["seq"]
    return rows
