"""A dead-letter store another process holds locked for a while is waited
out, not latched: give-ups (and parked records) wait in their routes, the
store reports itself unavailable (``/status``'s ``stores``, ``/metrics``),
and once the lock is gone every record is written.  Only a lock that
outlasts the store's ``lock_bound`` latches, naming the file.

Before, each give-up waited SQLite's 5 s busy timeout and then latched
``OperationalError: database is locked``: an operator's ``sqlite3`` session
held for a few seconds stopped ingestion for good.

Real SQLite locked by a real second process (``BEGIN EXCLUSIVE``), real
chDB behind a config-file service; the busy timeout is made short so the
lock outlasts several attempts quickly.  Nothing waits by sleeping: the
test reads the store's status until it says what happened.
"""

from __future__ import annotations

import uuid

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from taproute.actors import RoutingSink
from taproute.routing import FailurePolicy, Route, RoutingConfig
from taproute.routing.errors import RoutingFailure
from taproute.service import CaptureSink, DeadLetterStore, create_record_runtime
from taproute.service.host.config import load_config
from taproute.service.host.metrics import SnapshotCollector
from taproute.service.ops.parking import ParkedRecordStore
from tests.conftest import vec_batch
from tests.failing_processors import SCRIPT
from tests.processors import SCHEMA
from tests.test_dead_letters_locked import locked
from tests.test_operator_controls import config_text
from tests.test_runtime import eventually

BUSY = 0.05  # seconds one attempt waits for the lock


def _submit(runtime, hook: int, n: int = 4, seq_start: int = 0) -> None:
    batch = vec_batch(hook, n, seq_start=seq_start)
    runtime.submit_batch(batch.descriptors.copy(), bytes(batch.payload))


def test_give_ups_wait_out_a_locked_store_and_are_all_written(tmp_path, chdb_transport):
    """A config-file service (chDB, its dead-letter and park store in one
    file) keeps running while another process holds the file locked for
    many busy timeouts: no failure is latched, the store reads unavailable
    on the snapshot and on /metrics meanwhile, and after the lock every
    give-up is a dead letter."""
    dead = tmp_path / "dead.sqlite"
    path = tmp_path / "router.toml"
    path.write_text(
        config_text(chdb_transport.path, dead, "lw" + uuid.uuid4().hex[:8])
        + f"busy_timeout = {BUSY}\nlock_bound = 120.0\n"
    )
    SCRIPT.reset()
    SCRIPT.broken = True  # route "checked" gives every record up as malformed
    try:
        built = load_config(path).build()
        with built, built.start() as runtime:
            q = runtime.bind_hook("layers.0.q", layout="vec")
            _submit(runtime, q)
            runtime.flush()  # the store takes writes: 4 letters
            name = str(dead)
            assert runtime.counters().stores[name].available
            with locked(dead):
                for seq in range(4, 16, 4):
                    _submit(runtime, q, seq_start=seq)

                def waited_out_a_busy_timeout() -> bool:
                    store = runtime.counters().stores[name]
                    return store.locked_attempts >= 3 and store.waiting_writes >= 1

                eventually(waited_out_a_busy_timeout)
                snap = runtime.counters()
                store = snap.stores[name]
                assert not store.available and "locked" in (store.unavailable_reason or "")
                assert store.unavailable_since is not None and store.waiting_records >= 1
                assert snap.failure is None and runtime.failure is None  # nothing latched
                registry = CollectorRegistry()
                registry.register(SnapshotCollector(runtime.counters))
                scraped = generate_latest(registry).decode()
                assert f'taproute_store_available{{store="{name}"}} 0.0' in scraped
            report = runtime.flush()  # returns once every give-up is written
            assert report is not None and report.routes["checked"].dead_lettered == 16
            snap = runtime.counters()
            store = snap.stores[name]
            assert store.available and store.waiting_writes == store.waiting_records == 0
            assert store.locked_writes >= 1 and store.unavailable_reason is None
            assert snap.routes["checked"].failed == 16 and snap.failure is None
            assert built.dead_letters is not None
            assert built.dead_letters.counts() == {("checked", "handler_invalid"): 16}
        # the runtime's close raised nothing: no failure was latched
    finally:
        SCRIPT.reset()


def test_a_parked_record_waits_out_a_locked_store(tmp_path):
    """A retryable failure parks its records in the park store (the same
    file): the park write waits out the lock too, and a flush returns only
    once they are durable; nothing latches."""
    store = DeadLetterStore(tmp_path / "dead.sqlite", busy_timeout=BUSY, lock_bound=120)
    parking = ParkedRecordStore(store)
    sink = RoutingSink(
        RoutingConfig(
            [
                Route(
                    "transient",
                    "*",
                    "out",
                    mode="stateless",
                    processor="fail.always_transient",
                    failure_policy=FailurePolicy(initial_backoff=3600, max_backoff=3600),
                )
            ]
        ),
        SCHEMA,
        {"out": CaptureSink()},
        unmatched="drop",
        on_failure=parking.handle,
        park=parking,
    )
    SCRIPT.reset()
    try:
        with create_record_runtime(record_sink=sink) as runtime:
            q = runtime.bind_hook("layers.0.q", layout="vec")
            name = str(store.path)
            with locked(store.path):
                _submit(runtime, q)

                def parked_write_waits() -> bool:
                    status = runtime.counters().stores[name]
                    return status.locked_attempts >= 3 and status.waiting_records == 4

                eventually(parked_write_waits)
                assert not runtime.counters().stores[name].available
                assert runtime.failure is None
            report = runtime.flush()
            assert report is not None and report.parked == 4 and report.parked_durable
            assert parking.count("transient") == 4
            assert runtime.counters().stores[name].available
        assert parking.count("transient") == 4  # durable: left parked for the next start
    finally:
        SCRIPT.reset()
        store.close()


def test_a_lock_that_outlasts_the_bound_latches_naming_the_file(tmp_path):
    """Past ``lock_bound`` the give-up fails: the failure is latched, naming
    the file, how long it stayed locked and the bound."""
    path = tmp_path / "dead.sqlite"
    store = DeadLetterStore(path, busy_timeout=BUSY, lock_bound=0.5)
    sink = RoutingSink(
        RoutingConfig(
            [Route("r", "*", "out", mode="stateless", processor="fail.invalid_when_broken")]
        ),
        SCHEMA,
        {"out": CaptureSink()},
        unmatched="drop",
        on_failure=store.handle,
    )
    SCRIPT.reset()
    SCRIPT.broken = True
    try:
        runtime = create_record_runtime(record_sink=sink)
        q = runtime.bind_hook("layers.0.q", layout="vec")
        with locked(path):
            _submit(runtime, q, n=1)
            with pytest.raises(RoutingFailure, match="stayed locked") as raised:
                runtime.flush()
        message = str(raised.value)
        assert str(path) in message and "lock_bound of 0.5 s" in message
        assert "failure handler" in message
        with pytest.raises(RoutingFailure, match="stayed locked"):
            runtime.close()
        assert store.counts() == {}  # nothing was written
    finally:
        SCRIPT.reset()
        store.close()


@pytest.mark.parametrize(
    ("key", "value", "problem"),
    [("busy_timeout", -1, "busy_timeout"), ("lock_bound", float("nan"), "lock_bound")],
)
def test_bad_store_timeouts_are_refused_naming_them(tmp_path, key, value, problem):
    with pytest.raises(ValueError, match=problem):
        DeadLetterStore(tmp_path / "dead.sqlite", **{key: value})
    assert not (tmp_path / "dead.sqlite").exists()
