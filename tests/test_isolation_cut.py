"""Records of a failed batch still being re-run one by one when a shutdown's
grace runs out are counted as abandoned, each once.

The fault: a pool worker or stateful owner cut off at the grace counted its
batch abandoned only if the route had settled no record at all since the
batch started (``RouteActor._count_cut`` compared the route's settled total).
A batch being re-run record by record (after a non-retryable failure, or
once its retries ran out) had settled some already, so the rest, the record
whose call was cut off and those not yet tried, were counted nowhere:
accepted 4 = processed 1 + nothing.  On a stateful route a key retried
through the owner's mailbox (``_retry_key``) counted nothing at all when
cut off, whatever it had settled, and was not in the route's backlog while
it ran, so the grace did not cut the route off and ``ShutdownAbandoned``
did not name it.  Now what the cut task had not settled (its attempt's
tally) is counted abandoned, and a retried key is in the backlog while it
runs, as a stateless retry's message is.

Real parts: a runtime with its loop thread, a processor in a worker thread
that hangs on one record's own call, and the runtime's grace.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from taproute.native import make_descriptors
from taproute.routing import (
    Failed,
    FailurePolicy,
    InvalidInput,
    Records,
    Route,
    RoutingConfig,
    ShutdownAbandoned,
    SlotSpec,
    stateful_processor,
    stateless_processor,
)
from taproute.service import RoutingSink, create_record_runtime
from tests.processors import NORM, SCHEMA, norms
from tests.sinks import NullSink

VEC = SCHEMA.layout_id("vec")
HANG = threading.Event()
HUNG = threading.Event()
#: How a call over several records fails: "invalid" (re-run one by one at
#: once) or "transient" (re-run one by one once its retries ran out).
HOW = {"fail": "invalid"}
HANGING_SEQ = 1


def _behave(seqs: list[int]) -> Failed | None:
    """Fail a call over several records; hang in seq 1's own call."""
    if len(seqs) > 1:
        if HOW["fail"] == "invalid":
            raise InvalidInput("one of these records is malformed")
        return Failed("feature store restarting")
    if seqs == [HANGING_SEQ]:
        HUNG.set()
        HANG.wait(120)
    return None


@stateless_processor("isolation_cut.pool", input="vec", output="norm", needs_thread=True)
def pool_processor(records: Records):
    failed = _behave(records.descriptors["seq"].tolist())
    return norms(records) if failed is None else failed


@stateful_processor(
    "isolation_cut.keyed",
    key=lambda d: d["key"],
    key_range=4,
    slot=SlotSpec((1,), "int64"),
    input="vec",
    output="norm",
)
def keyed_processor(records: Records, keys: np.ndarray, state):
    failed = _behave(records.descriptors["seq"].tolist())
    if failed is not None:
        return failed
    rows = np.zeros(len(keys), dtype=NORM.dtype)
    rows["key"] = keys
    rows["seq"] = records.descriptors["seq"]
    return rows


@pytest.fixture(autouse=True)
def _events():
    HANG.clear()
    HUNG.clear()
    yield
    HANG.set()


@pytest.mark.parametrize(
    ("mode", "how", "retries"),
    [
        ("stateless", "invalid", 0),
        ("stateless", "transient", 0),
        ("stateless", "transient", 1),
        ("stateful", "invalid", 0),
        ("stateful", "transient", 0),
        ("stateful", "transient", 1),  # the key's last tries run in its retry
    ],
)
def test_a_batch_cut_off_while_re_run_one_by_one_counts_the_rest_abandoned(mode, how, retries):
    HOW["fail"] = how
    processor = "isolation_cut.pool" if mode == "stateless" else "isolation_cut.keyed"
    # Retries (if any) come back at once: no backoff to wait in real time.
    policy = FailurePolicy(
        deadline=600.0, initial_backoff=0, max_failures=retries + 1, failure_window=0
    )
    route = Route("r", "h.*", "ok", mode=mode, processor=processor, failure_policy=policy)
    ok = NullSink()
    sink = RoutingSink(RoutingConfig([route]), SCHEMA, {"ok": ok}, unmatched="drop")
    runtime = create_record_runtime(record_sink=sink, name="taproute-isolation-cut")
    released: list[int] = []
    try:
        hook = runtime.bind_hook("h.0", layout="vec")
        runtime.submit_batch(  # seqs 0..3, one key: a stateful route's one group
            make_descriptors(hook, 16, count=4, layout_ids=VEC, keys=np.zeros(4, np.int64)),
            np.zeros((4, 4), np.float32),
            release=lambda: released.append(1),
        )
        assert HUNG.wait(60)  # seq 0 delivered, seq 1's own call under way
        with pytest.raises(ShutdownAbandoned) as caught:
            runtime.close(timeout=0.6)
        assert caught.value.busy_routes == ("r",)
        r = runtime.snapshot().routes["r"]
    finally:
        HANG.set()
    assert (r.accepted, r.processed, r.failed, r.parked) == (4, 1, 0, 0)
    assert r.abandoned == 3  # seq 1 cut off, seqs 2 and 3 never tried: once each
    assert r.accepted == r.processed + r.failed + r.dropped + r.given_up + r.abandoned
    assert r.retries == retries
