"""A stateful call over several keys that fails gives up only its bad records.

The fault: a stateful route split a failed call's records by key, re-ran
record by record only the keys with more than one record, and gave up every
other key's single record as it was: good records of other keys were
dead-lettered with the bad one, just for sharing its batch (seen in
``test_output_check_raises``, which used one key to avoid it).  DESIGN:
"Per-record failures ... follow the route failure policy", and the README:
"only the bad record is given up".

Now each key's records of the failed call are run again in one call of their
own, and record by record only within a key whose call fails again.  The
processor here is a keyed running sum over real numpy state that writes the
whole batch into its slots *before* it finds a bad record (a NaN), so a
failed call's slots must be put back: the final state of every key equals
the sums of its good records, each applied once, and the dead-letter store
(real SQLite) holds the bad records alone.
"""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from taproute.actors import open_routing_sink
from taproute.native import make_descriptors
from taproute.routing import (
    FailurePolicy,
    HookRegistry,
    InvalidInput,
    RecordBatch,
    Records,
    Route,
    RoutingConfig,
    SlotSpec,
    stateful_processor,
)
from taproute.service import CaptureSink, DeadLetterStore
from tests.processors import NORM, SCHEMA, SUM

Q = "layers.0.q"
KEYS = 8

#: How the processor fails on a batch holding a NaN record, and its calls
#: (records per call), both set per test.
HOW = {"bad": "raises"}
CALLS: list[int] = []


@stateful_processor(
    "isolate.running_sum",
    key=lambda d: d["key"],
    key_range=KEYS,
    slot=SlotSpec((6,), "float64"),
    input="vec",
    output="sum",
)
def running_sum(records: Records, keys: np.ndarray, state) -> np.ndarray:
    """Per key: running total of the vectors (slot[:4]), count (slot[4]), and
    a decayed sum of its seqs (slot[5]: ``x / 2 + seq``, which the order of
    the key's records changes).  The whole batch is written to the state
    first; a NaN is found after."""
    CALLS.append(len(keys))
    values = records.rows()["values"].astype(np.float64)
    np.add.at(state.slots[:, :4], keys, values)
    np.add.at(state.slots[:, 4], keys, 1)
    for key, seq in zip(keys.tolist(), records.descriptors["seq"].tolist(), strict=True):
        state.slots[key, 5] = state.slots[key, 5] / 2 + seq
    if np.isnan(values).any():
        bad = int(np.flatnonzero(np.isnan(values).any(axis=1))[0])
        if HOW["bad"] == "raises":
            raise InvalidInput(f"record {bad}: NaN in its values")
        if HOW["bad"] == "panics":
            raise ValueError(f"record {bad}: NaN in its values")
        return np.zeros(len(keys), dtype=NORM.dtype)  # not the output layout
    rows = np.empty(len(keys), dtype=SUM.dtype)
    rows["key"] = keys
    rows["total"] = state.slots[keys, :4]
    rows["count"] = state.slots[keys, 4]
    return rows


CODES = {
    "raises": "handler_invalid",
    "panics": "handler_panic",
    "invalid_output": "handler_invalid",
}


@attrs.frozen
class Made:
    """A batch and what it holds (the reference is computed from these)."""

    batch: RecordBatch
    keys: np.ndarray
    seqs: np.ndarray
    values: np.ndarray

    @property
    def bad(self) -> np.ndarray:
        return np.isnan(self.values).any(axis=1)


def _batch(q: int, keys: list[int], seq_start: int, bad: set[int]) -> Made:
    """Records of ``keys`` with seqs from ``seq_start``; those whose seq is in
    ``bad`` hold a NaN."""
    n = len(keys)
    seqs = np.arange(seq_start, seq_start + n)
    rng = np.random.default_rng(seq_start)
    values = rng.standard_normal((n, 4)).astype(np.float32)
    values[np.isin(seqs, list(bad)), 1] = np.nan
    desc = make_descriptors(
        q, 16, count=n, layout_ids=SCHEMA.layout_id("vec"), keys=np.array(keys), seqs=seqs
    )
    return Made(RecordBatch.from_buffer(desc, values), np.array(keys), seqs, values.copy())


def _reference(made: list[Made]) -> tuple[np.ndarray, np.ndarray]:
    """The state the good records alone make (each once, in order), and which
    slots hold any."""
    slots = np.zeros((KEYS, 6))
    valid = np.zeros(KEYS, dtype=bool)
    for m in made:
        for key, seq, values, bad in zip(m.keys, m.seqs, m.values, m.bad, strict=True):
            if not bad:
                slots[key, :4] += values.astype(np.float64)
                slots[key, 4] += 1
                slots[key, 5] = slots[key, 5] / 2 + seq
                valid[key] = True
    return slots, valid


async def _run(tmp_path, hooks: HookRegistry, submissions: list[list[Made]], workers: int = 2):
    """Each inner list submitted together, then flushed."""
    store = DeadLetterStore(tmp_path / "letters.sqlite", hooks)
    out = CaptureSink()
    route = Route(
        "sums",
        Q,
        "out",
        mode="stateful",
        processor="isolate.running_sum",
        workers=workers,
        failure_policy=FailurePolicy(deadline=0),
    )
    async with open_routing_sink(
        RoutingConfig([route]),
        SCHEMA,
        {"out": out},
        unmatched="drop",
        hooks=hooks,
        on_failure=store.handle,
    ) as sink:
        for batches in submissions:
            for made in batches:
                await sink.submit(made.batch)
            await sink.flush()
        counters = sink.snapshot().routes["sums"]
        state = sink._gen.routes[0].state
        slots, valid = state.slots.copy(), state.valid.copy()
    letters = store.list(route="sums")
    store.close()
    return counters, slots, valid, letters, out


def _adds_up(r) -> bool:
    return r.accepted == r.processed + r.failed + r.dropped + r.given_up + r.parked


@pytest.fixture(autouse=True)
def _reset():
    HOW["bad"] = "raises"
    CALLS.clear()
    yield
    HOW["bad"] = "raises"


@pytest.mark.parametrize("how", ["raises", "panics", "invalid_output"])
async def test_one_bad_record_among_single_record_keys_is_dead_lettered_alone(tmp_path, how):
    """Eight keys, one record each, the record of key 3 bad: before, all eight
    were dead-lettered (each key's unit held one record, given up as it was)."""
    HOW["bad"] = how
    hooks = HookRegistry()
    q = hooks.bind(Q, layout="vec")
    good = _batch(q, list(range(KEYS)), 0, set())
    mixed = _batch(q, list(range(KEYS)), 100, {103})  # key 3's record is bad
    after = _batch(q, list(range(KEYS)), 200, set())
    counters, slots, valid, letters, out = await _run(tmp_path, hooks, [[good], [mixed], [after]])

    assert [(letter.key, letter.seq, letter.code) for letter in letters] == [(3, 103, CODES[how])]
    assert letters[0].route == "sums" and letters[0].attempts == 1
    ref_slots, ref_valid = _reference([good, mixed, after])
    np.testing.assert_allclose(slots, ref_slots, rtol=0, atol=1e-9)
    assert not np.isnan(slots).any()  # the failed calls' writes were put back
    assert (valid == ref_valid).all()
    assert (counters.accepted, counters.processed, counters.failed) == (24, 23, 1)
    assert (counters.dropped, counters.given_up, counters.parked) == (0, 0, 0)
    assert _adds_up(counters)
    assert len(out.rows("sums")) == 23
    # Batch-shaped when nothing fails (one call a batch, whatever the owners'
    # split); the failed call's keys re-run one call each, key 3's alone.
    # Owner 0 holds keys 0..3, owner 1 keys 4..7: a call each per batch, and
    # owner 0's keys one call each after its part of the mixed batch failed.
    assert sorted(CALLS) == [1] * 4 + [4] * 6


async def test_a_bad_record_inside_a_key_fails_only_itself_and_the_key_keeps_its_order(tmp_path):
    """Keys with several records each in one failing call: every other key's
    records are applied in one call; the bad key's record by record, its
    good records before and after the bad one applied once."""
    hooks = HookRegistry()
    q = hooks.bind(Q, layout="vec")
    keys = [0, 5, 1, 5, 2, 5, 3, 5, 0, 1, 2, 3, 4, 6, 7, 4]
    batch = _batch(q, keys, 0, {3})  # key 5's second record (seq 3)
    more = _batch(q, keys[::-1], 50, set())
    counters, slots, valid, letters, _ = await _run(tmp_path, hooks, [[batch], [more]], workers=1)

    assert [(letter.key, letter.seq) for letter in letters] == [(5, 3)]
    ref_slots, ref_valid = _reference([batch, more])
    np.testing.assert_allclose(slots, ref_slots, rtol=0, atol=1e-9)
    assert (valid == ref_valid).all()
    assert (counters.accepted, counters.processed, counters.failed) == (32, 31, 1)
    assert (counters.dropped, counters.given_up, counters.parked) == (0, 0, 0)
    assert _adds_up(counters)
    # The batch; keys 0..4, 6, 7 one call each, key 5 in one call; then its 4
    # records one by one; then the next batch in one call.
    assert CALLS == [16, 2, 2, 2, 2, 2, 4, 1, 1, 1, 1, 1, 1, 16]


@pytest.mark.parametrize("how", ["raises", "invalid_output"])
async def test_several_keys_each_with_one_bad_record(tmp_path, how):
    """Bad records of three keys in one batch, and more in batches queued
    together (an owner may take those in one thread hop): each bad record is
    dead-lettered alone, every key's state is its good records' sums."""
    HOW["bad"] = how
    hooks = HookRegistry()
    q = hooks.bind(Q, layout="vec")
    rng = np.random.default_rng(7)
    batches = [
        _batch(q, rng.integers(0, KEYS, 24).tolist(), 1000 * i, bad)
        for i, bad in enumerate([{1, 9, 17}, set(), {2010}, set(), {4000, 4023}, set()])
    ]
    one = _batch(q, [1, 4, 6, 1, 4, 6, 2], 9000, {9000, 9004, 9005})  # keys 1, 4, 6
    counters, slots, valid, letters, out = await _run(tmp_path, hooks, [[one], batches])

    bad = {
        (int(k), int(s))
        for m in [one, *batches]
        for k, s in zip(m.keys[m.bad], m.seqs[m.bad], strict=True)
    }
    assert len(bad) == 9
    assert sorted((letter.key, letter.seq) for letter in letters) == sorted(bad)
    assert {letter.code for letter in letters} == {"handler_invalid"}
    assert all(letter.attempts == 1 for letter in letters)
    ref_slots, ref_valid = _reference([one, *batches])
    np.testing.assert_allclose(slots, ref_slots, rtol=0, atol=1e-9)
    assert (valid == ref_valid).all()
    total = 7 + 24 * len(batches)
    assert (counters.accepted, counters.processed, counters.failed) == (total, total - 9, 9)
    assert (counters.dropped, counters.given_up, counters.parked) == (0, 0, 0)
    assert _adds_up(counters)
    assert len(out.rows("sums")) == total - 9
