"""A retryable failure one record causes gives up that record alone once retries run out.

The fault: a non-retryable failure was isolated (a batch re-run record by
record, a stateful call key by key first), but a *retryable* one was not.
Once a unit's retries ran out it was given up whole: a stateless route
dead-lettered its whole batch, a stateful route the failing key's whole
group, every good record with the one bad record that made each call fail
(a processor that raises ``ConnectionError`` whenever one particular record
is in its input).  DESIGN: "per-record failures ... follow the route failure
policy"; the README: "only the bad record is given up".

Now the records of a unit whose retries ran out are each run once more on
their own, in order, with no new retry budget: the bad record alone is
given up (after one try more than its batch had), every good one is
delivered once, and a stateful route's state is its good records applied
once each, in order (every failed call's writes were put back).  When every
record fails, all are given up, each once.  Real parts: the SQLite
dead-letter store, numpy state, Trio's autojump clock for the backoff.
"""

from __future__ import annotations

import threading
from collections import Counter

import numpy as np
import pytest

from taproute.actors import open_routing_sink
from taproute.routing import (
    Failed,
    FailurePolicy,
    HookRegistry,
    RecordBatch,
    Records,
    Route,
    RoutingConfig,
    SlotSpec,
    stateful_processor,
    stateless_processor,
)
from taproute.service import CaptureSink, DeadLetterStore
from tests.conftest import vec_batch
from tests.processors import NORM, SCHEMA, norms

Q = "layers.0.q"
KEYS = 8

#: Seqs whose presence in a call makes it fail (retryable), how it fails,
#: and the seqs of every call made, in order.
MARKED: set[int] = set()
HOW = {"fail": "raises"}
CALLS: list[list[int]] = []
#: What a hanging call waits for (set when each test ends).
HANG = threading.Event()
_lock = threading.Lock()

#: Three failures give up (no window): the first call and two retries.
POLICY = FailurePolicy(
    deadline=0, initial_backoff=1, multiplier=2, max_failures=3, failure_window=0
)


def _fail_if_marked(seqs: list[int]) -> Failed | None:
    with _lock:
        CALLS.append(seqs)
        marked = sorted(MARKED.intersection(seqs))
    if not marked:
        return None
    if HOW["fail"] == "hangs":  # past the route's deadline: abandoned, handler_timeout
        HANG.wait(60)  # released by the fixture: no thread outlives the test by much
        return Failed("released")
    if HOW["fail"] == "raises":
        raise ConnectionError(f"feature store reset while reading seq {marked[0]}")
    return Failed(f"seq {marked[0]} not ready")


@stateless_processor("retry_isolation.norms", input="vec", output="norm")
def marked_fail(records: Records) -> np.ndarray | Failed:
    failed = _fail_if_marked(records.descriptors["seq"].tolist())
    return norms(records) if failed is None else failed


@stateful_processor(
    "retry_isolation.running_sum",
    key=lambda d: d["key"],
    key_range=KEYS,
    slot=SlotSpec((3,), "float64"),
    input="vec",
    output="norm",
)
def running_sum(records: Records, keys: np.ndarray, state) -> np.ndarray | Failed:
    """Per key: sum of the first value (slot 0), count (slot 1) and a decayed
    sum of its seqs (slot 2: ``x / 2 + seq``, which the order of the key's
    records changes).  The whole call is written to the state before a
    marked record fails it."""
    seqs = records.descriptors["seq"].tolist()
    values = records.rows()["values"][:, 0].astype(np.float64)
    np.add.at(state.slots[:, 0], keys, values)
    np.add.at(state.slots[:, 1], keys, 1)
    for key, seq in zip(keys.tolist(), seqs, strict=True):
        state.slots[key, 2] = state.slots[key, 2] / 2 + seq
    failed = _fail_if_marked(seqs)
    if failed is not None:
        return failed
    rows = np.empty(len(keys), dtype=NORM.dtype)
    rows["key"] = keys
    rows["seq"] = seqs
    rows["norm"] = state.slots[keys, 2]
    return rows


@pytest.fixture(autouse=True)
def _reset():
    MARKED.clear()
    CALLS.clear()
    HOW["fail"] = "raises"
    HANG.clear()
    yield
    HANG.set()
    MARKED.clear()


def _route(mode: str, policy: FailurePolicy = POLICY) -> Route:
    processor = "retry_isolation.norms" if mode == "stateless" else "retry_isolation.running_sum"
    return Route("r", Q, "out", mode=mode, processor=processor, workers=1, failure_policy=policy)


async def _run(tmp_path, mode: str, batches, policy: FailurePolicy = POLICY):
    """Submit ``batches(q)`` to a route of ``mode``, flush waiting for every
    retry; the counters, the route's state (stateful), the dead letters."""
    hooks = HookRegistry()
    q = hooks.bind(Q, layout="vec")
    store = DeadLetterStore(tmp_path / "letters.sqlite", hooks)
    out = CaptureSink()
    async with open_routing_sink(
        RoutingConfig([_route(mode, policy)]),
        SCHEMA,
        {"out": out},
        unmatched="drop",
        hooks=hooks,
        on_failure=store.handle,
    ) as sink:
        made = batches(q)
        for batch in made:
            await sink.submit(batch)
        await sink.flush(wait=True)  # every retry done (autojump: no real waiting)
        counters = sink.snapshot().routes["r"]
        state = None
        if mode == "stateful":
            region = sink._gen.routes[0].state
            state = (region.slots.copy(), region.valid.copy())
    letters = store.list(route="r")
    store.close()
    return made, counters, state, letters, out


def _adds_up(r) -> bool:
    return r.accepted == r.processed + r.failed + r.dropped + r.given_up + r.parked


def _seqs_of(made: list[RecordBatch]) -> list[int]:
    return [s for batch in made for s in batch.descriptors["seq"].tolist()]


@pytest.mark.parametrize("how", ["raises", "returns_failed"])
async def test_stateless_one_marked_record_is_given_up_alone(tmp_path, how, autojump_clock):
    """A batch of 8 with seq 5 marked, and a clean batch after it: before,
    once the batch's three tries failed, all 8 were dead-lettered."""
    HOW["fail"] = how
    MARKED.add(5)
    made, counters, _, letters, out = await _run(
        tmp_path, "stateless", lambda q: [vec_batch(q, 8), vec_batch(q, 4, seq_start=100)]
    )

    assert [(letter.seq, letter.code) for letter in letters] == [(5, "handler_failed")]
    assert letters[0].attempts == 4  # the batch's 3 tries, then its own last one
    delivered = out.rows("r")["seq"].tolist()
    assert Counter(delivered) == Counter(s for s in _seqs_of(made) if s != 5)  # each once
    assert (counters.accepted, counters.processed, counters.failed) == (12, 11, 1)
    assert (counters.retries, counters.recovered) == (2, 7)
    assert (counters.dropped, counters.given_up, counters.parked) == (0, 0, 0)
    assert _adds_up(counters)
    # The batch three times, the clean batch once, then the batch's records
    # one by one, once each: seq 5 was in 4 calls, no more.
    batch = list(range(8))
    assert sorted(CALLS, key=len, reverse=True) == [batch] * 3 + [[100, 101, 102, 103]] + [
        [s] for s in batch
    ]
    assert CALLS[-8:] == [[s] for s in batch]


async def test_stateless_all_records_failing_are_given_up_each_once(tmp_path, autojump_clock):
    """Every record marked: all are still given up, each once (one dead
    letter, one ``failed``), after one last try each and no more retries."""
    MARKED.update(range(4))
    _, counters, _, letters, out = await _run(tmp_path, "stateless", lambda q: [vec_batch(q, 4)])

    assert sorted(letter.seq for letter in letters) == [0, 1, 2, 3]
    assert {(letter.code, letter.attempts) for letter in letters} == {("handler_failed", 4)}
    assert out.batches == []
    assert (counters.accepted, counters.processed, counters.failed) == (4, 0, 4)
    assert (counters.retries, counters.recovered) == (2, 0)
    assert (counters.parked, counters.given_up) == (0, 0)
    assert counters.failures_by_code == {"handler_failed": 4 * 3 + 4}  # 3 batch tries, 4 singles
    assert _adds_up(counters)
    assert CALLS == [[0, 1, 2, 3]] * 3 + [[0], [1], [2], [3]]


def _reference(made: list[RecordBatch]) -> tuple[np.ndarray, np.ndarray]:
    """The state the unmarked records alone make, each once, in submission
    order (a ``vec_batch`` record's first value is its seq)."""
    slots = np.zeros((KEYS, 3))
    valid = np.zeros(KEYS, dtype=bool)
    for batch in made:
        desc = batch.descriptors
        for key, seq in zip(desc["key"].tolist(), desc["seq"].tolist(), strict=True):
            if seq not in MARKED:
                slots[key] += (seq, 1, 0)
                slots[key, 2] = slots[key, 2] / 2 + seq
                valid[key] = True
    return slots, valid


async def test_stateful_one_marked_record_is_given_up_alone_and_its_key_keeps_order(
    tmp_path, autojump_clock
):
    """Key 1 holds three records of a batch over four keys, its second one
    (seq 3) marked; a later batch brings more of key 1 (they wait behind it)
    and of other keys.  Before, once key 1's group had failed three times,
    all three of its records were dead-lettered."""
    MARKED.add(3)
    first = [0, 1, 2, 1, 3, 1, 0]  # seqs 0..6: key 1 holds seqs 1, 3, 5
    later = [1, 4, 1, 0]  # seqs 100..103
    made, counters, state, letters, out = await _run(
        tmp_path,
        "stateful",
        lambda q: [
            vec_batch(q, 7, keys=np.array(first)),
            vec_batch(q, 4, keys=np.array(later), seq_start=100),
        ],
    )

    assert [(letter.key, letter.seq, letter.code) for letter in letters] == [
        (1, 3, "handler_failed")
    ]
    assert letters[0].attempts == 4  # key 1's group 3 times, then its own last try
    rows = out.rows("r")
    assert Counter(rows["seq"].tolist()) == Counter(s for s in _seqs_of(made) if s != 3)
    for key in range(KEYS):  # each key's records delivered in its order
        seqs = rows["seq"][rows["key"] == key].tolist()
        assert seqs == sorted(seqs)
    assert rows["seq"][rows["key"] == 1].tolist() == [1, 5, 100, 102]
    assert state is not None
    slots, valid = state
    ref_slots, ref_valid = _reference(made)
    np.testing.assert_allclose(slots, ref_slots, rtol=0, atol=1e-9)  # each good record once
    assert (valid == ref_valid).all()
    assert (counters.accepted, counters.processed, counters.failed) == (11, 10, 1)
    assert (counters.dropped, counters.given_up, counters.parked) == (0, 0, 0)
    assert _adds_up(counters)
    # Key 1's records were in at most 4 calls each: the batch, two retries of
    # its group, one last try each.
    in_calls = Counter(s for call in CALLS for s in call)
    assert (in_calls[1], in_calls[3], in_calls[5]) == (4, 4, 4)
    assert [1] in CALLS and [3] in CALLS and [5] in CALLS


async def test_stateful_all_records_failing_are_given_up_each_once(tmp_path, autojump_clock):
    """Every record of two keys marked: all given up, each once, and the
    state holds nothing of them."""
    MARKED.update(range(4))
    _, counters, state, letters, out = await _run(
        tmp_path, "stateful", lambda q: [vec_batch(q, 4, keys=np.array([0, 1, 0, 1]))]
    )

    given_up = sorted((letter.key, letter.seq) for letter in letters)
    assert given_up == [(0, 0), (0, 2), (1, 1), (1, 3)]
    assert {(letter.code, letter.attempts) for letter in letters} == {("handler_failed", 4)}
    assert out.batches == []
    assert (counters.accepted, counters.processed, counters.failed) == (4, 0, 4)
    assert (counters.parked, counters.given_up) == (0, 0)
    assert counters.failures_by_code == {"handler_failed": 4 * 3 + 4}
    assert _adds_up(counters)
    assert state is not None
    slots, valid = state
    assert not slots.any() and not valid.any()  # every failed call's writes put back
    assert len(CALLS) == 1 + 2 * 2 + 4  # the batch, each key's 2 retries, 4 last tries


@pytest.mark.parametrize("mode", ["stateless", "stateful"])
async def test_a_last_try_that_times_out_gives_the_rest_up_untried(tmp_path, mode, autojump_clock):
    """A processor that hangs on every call: after the batch's three tries
    timed out, one last try (which times out too) and the rest given up
    untried.  Each last try that timed out would hold the route for one more
    deadline per record (a batch of thousands: hours), its mailbox and then
    ingress filling behind it."""
    HOW["fail"] = "hangs"
    MARKED.update(range(4))
    policy = FailurePolicy(
        deadline=1, initial_backoff=1, multiplier=2, max_failures=3, failure_window=0
    )
    _, counters, _, letters, out = await _run(
        tmp_path, mode, lambda q: [vec_batch(q, 4, keys=0)], policy
    )

    assert sorted(letter.seq for letter in letters) == [0, 1, 2, 3]
    assert {letter.code for letter in letters} == {"handler_timeout"}
    assert out.batches == []
    assert (counters.accepted, counters.failed) == (4, 4)
    assert counters.failures_by_code == {"handler_timeout": 4 * 3 + 1}  # 3 batch tries, 1 single
    assert _adds_up(counters)
    # A try may time out before its call starts (the abandoned calls still
    # hold the route's worker threads), so count calls, not their order: the
    # batch's, then record 0's last try at most; 1, 2 and 3 never alone.
    assert len(CALLS) <= 4 and [seqs for seqs in CALLS if len(seqs) == 1] in ([], [[0]])
