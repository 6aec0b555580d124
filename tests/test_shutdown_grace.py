"""A destination whose call never returns no longer holds shutdown for ever.

``close()`` without a timeout waited for ever, and ``close(timeout)`` raised
``TimeoutError`` but left the loop thread running for good.  Now close is
bounded by the runtime's shutdown grace (or its timeout): the destinations
still busy near its end are cut off, the healthy ones are flushed and
closed as usual, the loop thread ends, and ``ShutdownAbandoned`` (a
``TimeoutError``) names what was busy and how many records were given up.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import numpy as np
import pytest
import trio
from prometheus_client import CollectorRegistry, generate_latest

from taproute.native import make_descriptors
from taproute.routing import (
    ConfigError,
    Failed,
    FailurePolicy,
    FlushCutOff,
    Route,
    RoutingConfig,
    ShutdownAbandoned,
    SlotSpec,
    stateful_processor,
    stateless_processor,
)
from taproute.service import ClickHouseSink, RoutingSink, create_record_runtime
from taproute.service.host.config import ConfigFileError, ShutdownOptions, load_config
from taproute.service.host.metrics import SnapshotCollector
from taproute.service.host.runtime import LOOP_END_S, RecordRuntime
from tests.processors import SCHEMA
from tests.sinks import HeldInThread, HeldSubmit, NullSink, StallsLoop

VEC = SCHEMA.layout_id("vec")
#: Slack for a loaded machine on top of what close promises.
SLACK_S = 1.5


def _fan_out(held: object, ok: NullSink, **options: object):
    """A runtime whose every record goes to destination "held" and to "ok"."""
    sink = RoutingSink(
        RoutingConfig([Route("to_held", "h.*", "held"), Route("to_ok", "h.*", "ok")]),
        SCHEMA,
        {"held": held, "ok": ok},
        unmatched="drop",
    )
    return create_record_runtime(record_sink=sink, name="taproute-grace", **options)


def _submit(runtime: RecordRuntime, batches: int, released: list[int]) -> None:
    hook = runtime.bind_hook("h.0", layout="vec")
    for _ in range(batches):
        runtime.submit_batch(
            make_descriptors(hook, 16, count=4, layout_ids=VEC),
            np.zeros((4, 4), np.float32),
            release=lambda: released.append(1),
        )


def _clickhouse_on(chdb_transport, table: str) -> ClickHouseSink:
    """A ClickHouse sink on the fixture's chDB (not owning it) writing raw
    ``vec`` records to ``table``; its close_timeout is longer than any grace
    here, so the grace decides."""
    return ClickHouseSink(
        chdb_transport,
        SCHEMA,
        raw=["vec"],
        create_tables=True,
        raw_table=table,
        owns_transport=False,
        close_timeout=60.0,
    )


def _hold_inserts(ch, entered, release, left=None):
    """Make ``ch``'s inserts wait for ``release``: ``entered`` is set when one
    waits, ``left`` (if given) when it has returned."""
    insert = ch._insert_blocking

    def held_insert(*args):
        entered.set()
        release.wait()
        insert(*args)
        if left is not None:
            left.set()

    ch._insert_blocking = held_insert  # type: ignore[method-assign]
    return ch


def _embedded_clickhouse(chdb_transport, table, made, entered=None, release=None):
    """A factory of ClickHouse sinks owning a transport of their own on the
    fixture's chDB directory (released only by the sink), writing raw
    ``vec`` records to ``table``; each sink made goes in ``made``, its
    inserts held (``_hold_inserts``) when given ``entered`` and ``release``."""

    def clickhouse() -> ClickHouseSink:
        ch = ClickHouseSink.embedded(
            SCHEMA, chdb_transport.path, raw=["vec"], raw_table=table, close_timeout=60.0
        )
        if entered is not None:
            _hold_inserts(ch, entered, release)
        made.append(ch)
        return ch

    return clickhouse


def _loop_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "taproute-grace"]


@pytest.mark.parametrize("where", ["trio", "thread"])
def test_a_submit_that_never_returns_is_cut_off_at_the_grace(where):
    held = HeldSubmit() if where == "trio" else HeldInThread()
    ok = NullSink()
    runtime = _fan_out(held, ok)
    released: list[int] = []
    _submit(runtime, 5, released)
    assert held.entered.wait(10)
    started = time.monotonic()
    with pytest.raises(ShutdownAbandoned) as caught:
        runtime.close(timeout=0.5)
    assert time.monotonic() - started < 0.5 + SLACK_S
    error = caught.value
    assert isinstance(error, TimeoutError)  # what close(timeout) raised before
    assert error.busy == {"held": "submit"}
    assert error.abandoned_records == {"held": 20}
    assert error.abandoned_batches == {"held": 5}
    assert error.records == 20 and error.loop_ended
    assert "'held' (in submit) still busy" in str(error)
    assert "'held' 20 records in 5 batches" in str(error)
    # The loop thread ended; the healthy destination got every record and
    # was closed; every buffer went back once.
    assert _loop_threads() == []
    assert ok.records == 20 and ok.flushes == 1
    assert held.records == 0
    assert len(released) == 5
    snap = runtime.snapshot()
    assert snap.destinations["held"].abandoned_records == 20
    assert snap.destinations["held"].cut_short == "submit"
    assert snap.destinations["ok"].abandoned_records == 0
    assert snap.destinations["ok"].records == 20
    assert snap.failure is not None and "ShutdownAbandoned" in snap.failure
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(runtime.snapshot))
    text = generate_latest(registry).decode()
    assert 'taproute_destination_abandoned_records_total{destination="held"} 20.0' in text
    assert 'taproute_destination_abandoned_batches_total{destination="held"} 5.0' in text
    # A later close says the same again, at once.
    with pytest.raises(ShutdownAbandoned) as again:
        runtime.close()
    assert again.value is error
    if isinstance(held, HeldInThread):  # the abandoned thread still waits; let it go
        assert not held.left.is_set()
        held.release.set()
        assert held.left.wait(10)


def test_a_flush_that_never_returns_is_cut_off_and_the_others_are_flushed():
    held = HeldInThread(in_flush=True)
    ok = NullSink()
    runtime = _fan_out(held, ok)
    released: list[int] = []
    _submit(runtime, 3, released)
    started = time.monotonic()
    with pytest.raises(ShutdownAbandoned) as caught:
        runtime.close(timeout=0.4)
    assert time.monotonic() - started < 0.4 + SLACK_S
    assert caught.value.busy == {"held": "flush"}
    # Every record reached both sinks; the held one never confirmed them.
    assert caught.value.abandoned_records == {}
    assert "abandoned: nothing queued" in str(caught.value)
    assert held.records == 12 and held.flushes == 0
    assert ok.records == 12 and ok.flushes == 1
    assert _loop_threads() == [] and len(released) == 3
    held.release.set()
    assert held.left.wait(10)


def test_leaving_the_with_block_is_bounded_by_the_configured_grace():
    held = HeldSubmit()
    ok = NullSink()
    released: list[int] = []
    started = math.nan
    with (
        pytest.raises(ShutdownAbandoned, match="grace of 0.3 s ran out with 'held'"),
        _fan_out(held, ok, shutdown_grace=0.3) as runtime,
    ):
        _submit(runtime, 2, released)
        assert held.entered.wait(10)
        started = time.monotonic()
    assert time.monotonic() - started < 0.3 + SLACK_S
    assert _loop_threads() == []
    assert ok.records == 8 and len(released) == 2


def test_a_loop_blocked_by_its_sink_is_reported_and_left_running():
    """A sink that blocks the loop thread itself cannot be interrupted: close
    returns about LOOP_END_S past the grace saying so; once the call returns,
    the loop ends, and a later close waits for it and says the same again."""
    held = StallsLoop()
    entered = threading.Event()
    submit = held.submit

    async def submit_and_tell(batch):
        entered.set()
        await submit(batch)

    held.submit = submit_and_tell  # type: ignore[method-assign]
    runtime = _fan_out(held, NullSink())
    released: list[int] = []
    try:
        _submit(runtime, 1, released)
        assert entered.wait(10)
        started = time.monotonic()
        with pytest.raises(ShutdownAbandoned) as caught:
            runtime.close(timeout=0.2)
        assert time.monotonic() - started < 0.2 + LOOP_END_S + SLACK_S
        error = caught.value
        assert not error.loop_ended
        # (read while the loop is blocked: "ok" may have a batch queued too)
        assert error.busy["held"] == "submit"
        assert "the loop thread is blocked in a call that cannot be cancelled" in str(error)
        assert _loop_threads() != []
    finally:
        held.release.set()
    with pytest.raises(ShutdownAbandoned) as again:
        runtime.close(timeout=30)
    assert again.value is error
    assert _loop_threads() == []
    assert len(released) == 1


def test_a_clean_close_within_the_grace_is_as_before():
    ok = NullSink()
    runtime = _fan_out(NullSink(), ok, shutdown_grace=5)
    released: list[int] = []
    _submit(runtime, 3, released)
    runtime.close()
    runtime.close()  # idempotent
    assert ok.records == 12 and len(released) == 3
    snap = runtime.snapshot()
    assert snap.failure is None
    assert all(d.abandoned_records == 0 for d in snap.destinations.values())


@pytest.mark.parametrize("value", [-1, math.nan, "30", None, True])
def test_a_bad_shutdown_grace_is_refused_naming_it(value):
    sink = RoutingSink(
        RoutingConfig([Route("r", "h.*", "out")]), SCHEMA, {"out": NullSink()}, unmatched="drop"
    )
    with pytest.raises(ConfigError, match=r"shutdown_grace: expected seconds >= 0.*found"):
        RecordRuntime(sink, shutdown_grace=value)  # type: ignore[arg-type]


SHUTDOWN_FILE = """
layouts = []
routes = []
[destinations.d]
path = "x"
[routing]
unmatched = "drop"
[shutdown]
grace = @GRACE@
"""


@pytest.mark.parametrize(
    ("grace", "problem"),
    [
        ("-1", "shutdown.grace: must be in [0, 3600], found -1"),
        ("nan", "shutdown.grace: expected a finite number, found nan"),
        ('"30"', "shutdown.grace: expected a number, found string '30'"),
        ("7200", "shutdown.grace: must be in [0, 3600], found 7200"),
    ],
)
def test_a_bad_grace_in_a_config_file_names_its_key(tmp_path, grace, problem):
    path = tmp_path / "router.toml"
    path.write_text(SHUTDOWN_FILE.replace("@GRACE@", grace))
    with pytest.raises(ConfigFileError) as caught:
        load_config(path)
    assert caught.value.problems == [problem]


def test_the_grace_of_a_config_file_is_the_services(tmp_path, chdb_transport):
    from tests.test_config_file import base

    path = tmp_path / "router.toml"
    path.write_text(base(chdb_transport, "grace") + "\n[shutdown]\ngrace = 2.5\n")
    config = load_config(path)
    assert config.shutdown == ShutdownOptions(grace=2.5)
    with config.build() as built:
        service = built.start()
        assert service.shutdown_grace == 2.5
        service.close()
    path.write_text(base(chdb_transport, "grace"))
    assert load_config(path).shutdown.grace == 30.0


@pytest.mark.parametrize("value", [-0.5, math.nan, math.inf, "30"])
def test_shutdown_options_refuse_what_a_file_would(value):
    with pytest.raises(ConfigError, match=r"ShutdownOptions: grace must be a finite number in"):
        ShutdownOptions(grace=value)


def test_a_chdb_insert_that_does_not_return_is_abandoned_at_the_grace(chdb_transport):
    """chDB in this process: an insert runs in a worker thread, which nothing
    interrupts.  At the grace the sink's close is cut off and the thread
    abandoned (the loop ends); the insert runs on, and its rows still land
    once it returns (the transport is not closed under it)."""
    import uuid

    table = f"grace_{uuid.uuid4().hex[:8]}"
    entered, release, left = threading.Event(), threading.Event(), threading.Event()
    ch = _hold_inserts(_clickhouse_on(chdb_transport, table), entered, release, left)
    ok = NullSink()
    runtime = _fan_out(lambda: ch, ok)  # a factory: the routing sink closes it
    released: list[int] = []
    try:
        _submit(runtime, 3, released)
        started = time.monotonic()
        with pytest.raises(ShutdownAbandoned) as caught:
            runtime.close(timeout=1.0)
        assert time.monotonic() - started < 1.0 + SLACK_S
        assert entered.is_set()
        assert caught.value.busy == {"held": "close"} and caught.value.loop_ended
        assert _loop_threads() == [] and ok.records == 12
        assert not left.is_set()  # abandoned, not interrupted
    finally:
        release.set()
    assert left.wait(30)
    rows = chdb_transport.query(f"SELECT count() AS n FROM `{table}`").column("n")[0].as_py()
    assert rows == 12
    assert len(released) == 3


#: What the hanging processor below waits for (set by its test when done).
HANG = threading.Event()
HUNG = threading.Event()


@stateless_processor("test.grace_hang", input="vec", output="norm", needs_thread=True)
def grace_hang(records):
    HUNG.set()
    HANG.wait()
    return np.zeros(0, SCHEMA.layout("norm").dtype)


def _hung_route_beside_a_forward_one(ok: NullSink) -> RecordRuntime:
    """A runtime whose route "slow" calls ``test.grace_hang`` (it does not
    return until HANG is set; HUNG says it is in the call) beside a forward
    route "raw", both into ``ok``."""
    HANG.clear()
    HUNG.clear()
    sink = RoutingSink(
        RoutingConfig(
            [
                Route(
                    "slow",
                    "h.*",
                    "ok",
                    mode="stateless",
                    processor="test.grace_hang",
                    workers=1,
                    failure_policy=FailurePolicy(deadline=600.0),
                ),
                Route("raw", "h.*", "ok"),
            ]
        ),
        SCHEMA,
        {"ok": ok},
        unmatched="drop",
    )
    return create_record_runtime(record_sink=sink, name="taproute-grace")


def test_a_processor_that_does_not_return_is_cancelled_at_the_end_of_the_grace():
    """No destination is busy: nothing is cut near the end; at the end the
    loop is cancelled, the route's queued records are given back and counted,
    and the error names the route still processing."""
    ok = NullSink()
    runtime = _hung_route_beside_a_forward_one(ok)
    released: list[int] = []
    try:
        _submit(runtime, 4, released)
        assert HUNG.wait(10)
        started = time.monotonic()
        with pytest.raises(ShutdownAbandoned) as caught:
            runtime.close(timeout=0.5)
        assert time.monotonic() - started < 0.5 + SLACK_S
        error = caught.value
        assert error.busy == {} and error.busy_routes == ("slow",)
        # the batch in the call and the three queued behind it
        assert error.route_records == 16
        assert "route 'slow' (processing) still busy" in str(error)
        assert "16 records in routes" in str(error)
        assert error.loop_ended and _loop_threads() == []
        assert ok.records == 16  # the forward route's, all
        assert ok.flushes == 1  # flushed (a leased sink: not closed), as the grace promises
        slow = runtime.snapshot().routes["slow"]
        assert slow.abandoned == 16 and slow.processed == 0
    finally:
        HANG.set()


def test_a_hung_processor_does_not_keep_the_other_routes_rows_from_clickhouse(chdb_transport):
    """A processor that outlived the grace kept the close waiting for the
    routes until the loop was cancelled: the destinations were never flushed
    or closed, so rows a ClickHouse sink had buffered for the healthy route
    were lost, counted as sent and abandoned nowhere.  Now the busy routes
    are cut near the end of the grace and the destinations flushed and
    closed with what the routes had delivered."""
    HANG.clear()
    HUNG.clear()
    table = "grace_routes_raw_{layout}"
    made: list[ClickHouseSink] = []

    def clickhouse() -> ClickHouseSink:
        made.append(
            ClickHouseSink(
                chdb_transport,
                SCHEMA,
                raw=["vec"],
                raw_table=table,
                rows=["norm"],
                rows_table="grace_routes_{layout}",
                create_tables=True,
                owns_transport=False,
            )
        )
        return made[0]

    hung = Route(
        "slow",
        "h.*",
        "ch",
        mode="stateless",
        processor="test.grace_hang",
        workers=1,
        failure_policy=FailurePolicy(deadline=600.0),
    )
    sink = RoutingSink(
        RoutingConfig([hung, Route("raw", "h.*", "ch")]),
        SCHEMA,
        {"ch": clickhouse},
        unmatched="drop",
    )
    runtime = create_record_runtime(record_sink=sink, name="taproute-grace")
    released = threading.Semaphore(0)
    hook = runtime.bind_hook("h.0", layout="vec")
    try:
        for _ in range(5):
            runtime.submit_batch(
                make_descriptors(hook, 16, count=4, layout_ids=VEC),
                np.zeros((4, 4), np.float32),
                release=released.release,
            )
        assert HUNG.wait(10)
        with pytest.raises(ShutdownAbandoned) as caught:
            runtime.close(timeout=1.0)
        assert caught.value.busy_routes == ("slow",) and caught.value.busy == {}
        assert caught.value.route_records == 20 and caught.value.loop_ended
    finally:
        HANG.set()
    # Every buffer goes back once; the one the abandoned call reads, when it returns.
    assert all(released.acquire(timeout=10) for _ in range(5))
    rows = chdb_transport.query("SELECT count() AS n FROM grace_routes_raw_vec").to_pylist()
    assert rows == [{"n": 20}]  # every record of the healthy route, in ClickHouse
    assert made[0].table_counters()["grace_routes_raw_vec"].buffered_rows == 0


def _flush_in_thread(runtime: RecordRuntime) -> tuple[threading.Thread, list[BaseException]]:
    """A flush (no timeout) in a thread of its own; what it raised goes in the list."""
    raised: list[BaseException] = []

    def flush() -> None:
        try:
            runtime.flush()
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=flush, daemon=True)
    thread.start()
    return thread, raised


def test_a_flush_overtaken_by_the_grace_raises_instead_of_reporting_delivery():
    """A flush waiting on a destination that the closing grace cut off
    returned a FlushReport as if it had finished (delivered=4 for records
    its flush never confirmed): now it raises FlushCutOff naming what was
    cut, and the runtime's failure stays the shutdown's."""
    held = HeldInThread(in_flush=True)
    ok = NullSink()
    runtime = _fan_out(held, ok)
    released: list[int] = []
    _submit(runtime, 1, released)
    thread, raised = _flush_in_thread(runtime)
    try:
        assert held.entered.wait(10)  # the flush waits in the held destination's flush
        with pytest.raises(ShutdownAbandoned) as caught:
            runtime.close(timeout=0.5)
        thread.join(10)
        assert not thread.is_alive()
        assert len(raised) == 1 and isinstance(raised[0], FlushCutOff)
        assert "cut off destination 'held' (in flush)" in str(raised[0])
        assert caught.value.failure is None  # the flush's error is the caller's, not latched
        assert caught.value.busy == {"held": "flush"}
    finally:
        held.release.set()


def test_a_flush_waiting_on_a_hung_processor_does_not_hold_the_close_up():
    """A flush waiting for a hung route held the routing sink's lock, so the
    close could not start its own flush until the loop was cancelled: the
    healthy destination was never flushed.  Cutting the route frees the
    flush (FlushCutOff) and the close flushes the healthy destination."""
    ok = NullSink()
    runtime = _hung_route_beside_a_forward_one(ok)
    released: list[int] = []
    try:
        _submit(runtime, 3, released)
        assert HUNG.wait(10)
        thread, raised = _flush_in_thread(runtime)
        started = time.monotonic()
        with pytest.raises(ShutdownAbandoned) as caught:
            runtime.close(timeout=1.0)
        assert time.monotonic() - started < 1.0 + SLACK_S
        thread.join(10)
        assert not thread.is_alive()
        assert len(raised) == 1 and isinstance(raised[0], FlushCutOff)
        assert "the routes still processing" in str(raised[0])
        assert caught.value.busy_routes == ("slow",) and caught.value.route_records == 12
        # the forward route's, all; flushed by the overtaken flush, then by the close
        assert ok.records == 12 and ok.flushes == 2
    finally:
        HANG.set()


#: The shutdown tests' hanging stateful processors: 4 keys, one float each,
#: in worker threads (a hung call must not block the loop).
_KEYED_BY_4: dict[str, Any] = {
    "key": lambda d: d["key"] % 4,
    "key_range": 4,
    "slot": SlotSpec((1,), "float64"),
    "input": "vec",
    "output": "norm",
    "needs_thread": True,
}


@stateful_processor("test.grace_hang_keyed", **_KEYED_BY_4)
def grace_hang_keyed(records, keys, state):
    HUNG.set()
    HANG.wait()
    return np.zeros(0, SCHEMA.layout("norm").dtype)


def _keyed_runtime(
    processor: str,
    ok: NullSink,
    *,
    workers: int = 1,
    beside: list[Route] | None = None,
    policy: dict[str, float] | None = None,
) -> RecordRuntime:
    """A runtime whose stateful route ``keyed`` runs ``processor`` (one that
    hangs on HANG, saying so on HUNG: both cleared here) into ``ok``, with
    the routes ``beside`` it; the route's deadline outlasts any grace here."""
    HANG.clear()
    HUNG.clear()
    keyed = Route(
        "keyed",
        "h.*",
        "ok",
        mode="stateful",
        processor=processor,
        workers=workers,
        failure_policy=FailurePolicy(deadline=600.0, **(policy or {})),
    )
    sink = RoutingSink(
        RoutingConfig([keyed, *(beside or [])]), SCHEMA, {"ok": ok}, unmatched="drop"
    )
    return create_record_runtime(record_sink=sink, name="taproute-grace")


def test_a_stateful_call_cut_off_at_the_grace_counts_its_records():
    """The records in a stateful owner's call that the grace cut off were
    counted nowhere (accepted 24 = processed 0 + abandoned 20): every
    accepted record is now processed or counted as abandoned."""
    ok = NullSink()
    runtime = _keyed_runtime(
        "test.grace_hang_keyed", ok, workers=2, beside=[Route("raw", "h.*", "ok")]
    )
    released: list[int] = []
    try:
        _submit(runtime, 6, released)
        assert HUNG.wait(10)
        with pytest.raises(ShutdownAbandoned) as caught:
            runtime.close(timeout=0.6)
        assert caught.value.busy_routes == ("keyed",)
        route = runtime.snapshot().routes["keyed"]
        assert route.accepted == 24 and route.processed == 0 and route.abandoned == 24
        assert caught.value.route_records == 24
        assert ok.records == 24 and ok.flushes == 1
    finally:
        HANG.set()


def test_a_key_control_queued_behind_a_hung_stateful_call_is_given_up_with_it():
    """Giving back what a stateful owner still had queued tripped over a
    complete/cancel queued there ('KeyControl' object is not subscriptable):
    the loop crashed, and close raised SinkClosed instead of saying what the
    grace cut off."""
    runtime = _keyed_runtime("test.grace_hang_keyed", NullSink())
    released: list[int] = []
    try:
        _submit(runtime, 2, released)  # the first call hangs, the second waits behind it
        assert HUNG.wait(10)
        runtime.complete(1).result(10)  # queued in the owner's mailbox behind them
        runtime.cancel(2).result(10)
        with pytest.raises(ShutdownAbandoned) as caught:
            runtime.close(timeout=0.5)
        assert caught.value.busy_routes == ("keyed",) and caught.value.loop_ended
        snapshot = runtime.snapshot()
        assert snapshot.failure is not None and "ShutdownAbandoned" in snapshot.failure
        assert snapshot.routes["keyed"].abandoned == 8
    finally:
        HANG.set()


@stateful_processor("test.grace_key0_down_key1_hangs", **_KEYED_BY_4)
def key0_down_key1_hangs(records, keys, state):
    if 1 in keys.tolist():
        HUNG.set()
        HANG.wait()
    if 0 in keys.tolist():
        return Failed("feature store down for key 0")
    return np.zeros(0, SCHEMA.layout("norm").dtype)


def test_records_parked_or_waiting_behind_their_key_when_the_grace_cuts_are_counted():
    """A record parked for a retry, and the records of its key waiting behind
    it, were let go without a count when the grace cut their owner off:
    accepted records were neither processed, dropped, failed nor abandoned.
    Without a park store they are counted as abandoned now."""
    runtime = _keyed_runtime(
        "test.grace_key0_down_key1_hangs", NullSink(), policy={"initial_backoff": 60.0}
    )
    hook = runtime.bind_hook("h.0", layout="vec")
    try:
        for key in (0, 0, 0, 1):  # key 0 fails and parks; two wait behind it; key 1 hangs
            runtime.submit_batch(
                make_descriptors(hook, 16, count=1, layout_ids=VEC, keys=np.array([key])),
                np.zeros((1, 4), np.float32),
            )
        assert HUNG.wait(10)
        assert runtime.snapshot().routes["keyed"].parked == 3
        with pytest.raises(ShutdownAbandoned):
            runtime.close(timeout=0.5)
        counted = runtime.snapshot().routes["keyed"]
        assert counted.accepted == 4 and counted.processed == 0
        assert counted.abandoned == 4  # the parked three and the hung call's one
    finally:
        HANG.set()


def test_rows_a_cut_clickhouse_sink_had_taken_are_counted_given_up(chdb_transport):
    """A flush waiting on a ClickHouse insert that the grace cut off ("in
    flush"): the rows the sink had taken were counted as sent by the
    destination (12 sent, 0 abandoned) while nothing counted them as given
    up (the cut's cancel left even the sink's ``abandoned_rows`` at 0), and
    ``taproute run``'s summary said "12 rows sent".  Now the sink counts them
    (``abandoned_rows``), the destination counts them given up (still sent:
    a counter never goes down), ShutdownAbandoned names them and the summary
    shows them."""
    import io
    import uuid

    from taproute.service.host.loadgen import print_summary

    table = f"grace_cut_{uuid.uuid4().hex[:8]}"
    entered, release = threading.Event(), threading.Event()
    made: list[ClickHouseSink] = []

    def clickhouse() -> ClickHouseSink:
        ch = _hold_inserts(_clickhouse_on(chdb_transport, table), entered, release)
        made.append(ch)
        return ch

    ok = NullSink()
    runtime = _fan_out(clickhouse, ok)
    released: list[int] = []
    try:
        _submit(runtime, 3, released)
        thread, raised = _flush_in_thread(runtime)
        assert entered.wait(10)  # the flush waits for the held insert
        with pytest.raises(ShutdownAbandoned) as caught:
            runtime.close(timeout=0.5)
        thread.join(10)
        assert len(raised) == 1 and isinstance(raised[0], FlushCutOff)
        assert caught.value.busy == {"held": "flush"}
        assert caught.value.abandoned_records == {"held": 12}
        assert "abandoned: 'held' 12 records" in str(caught.value)
        (counters,) = made[0].table_counters().values()
        assert counters.abandoned_rows == 12 and counters.in_flight_rows == 0
        snap = runtime.counters()
        held = snap.destinations["held"]
        # Handed over (sent never goes down), then given up by the sink.
        assert (held.records, held.given_up_records, held.abandoned_records) == (12, 12, 0)
        assert held.cut_short == "flush"
        assert snap.destinations["ok"].records == 12
        out = io.StringIO()
        print_summary(snap, out)
        assert (
            "destination held: 12 rows sent (from routes to_held 12), "
            "12 of them given up by the sink" in out.getvalue()
        )
    finally:
        release.set()


def test_a_cut_clickhouse_sink_lets_go_of_its_chdb_directory(chdb_transport):
    """A ClickHouse destination the grace cut off was never closed, so its
    transport was never released: the chDB session on its directory stayed
    open for the life of the process (``ClickHouseSink.embedded`` on any
    other directory then raised "chDB already has ... open"), with its
    insert connections.  Now the cut sink lets go of it once the insert
    the cut abandoned returns, never under it (its rows still land)."""
    import uuid

    from taproute.routing import SinkClosed
    from taproute.service.sinks.clickhouse.transport import _SharedSession

    table = f"grace_release_{uuid.uuid4().hex[:8]}"
    users = _SharedSession.users  # the fixture's transport on the same directory
    entered, release = threading.Event(), threading.Event()
    made: list[ClickHouseSink] = []

    runtime = _fan_out(
        _embedded_clickhouse(chdb_transport, table, made, entered, release), NullSink()
    )
    try:
        _submit(runtime, 3, [])
        thread, _raised = _flush_in_thread(runtime)
        assert entered.wait(10)
        with pytest.raises(ShutdownAbandoned):
            runtime.close(timeout=0.5)
        thread.join(10)
        (ch,) = made
        assert _SharedSession.users == users + 1  # not closed under the insert
        with pytest.raises(SinkClosed):
            ch.check_tables()  # later calls are refused at once
    finally:
        release.set()
    assert ch._calls.wait_released(10)  # closed when the abandoned insert returned
    assert _SharedSession.users == users
    rows = chdb_transport.query(f"SELECT count() AS n FROM `{table}`").column("n")[0].as_py()
    assert rows == 12


def _spooling_clickhouse(chdb_transport, directory, table, mode, entered, release, made):
    """A factory of a spooling destination ("held") on chDB whose inserts
    wait for ``release`` (``entered`` says one is waiting)."""
    from taproute.service.sinks.spool import Spool, SpoolConfig
    from taproute.service.sinks.spool.spooling import SpoolingSink

    def factory() -> SpoolingSink:
        ch = _hold_inserts(_clickhouse_on(chdb_transport, table), entered, release)
        made.append(ch)
        return SpoolingSink("held", ch, Spool.open(SpoolConfig(directory=directory)), mode=mode)

    return factory


def test_rows_a_cut_spooling_clickhouse_sink_lost_are_counted_given_up(chdb_transport, tmp_path):
    """A spooling ClickHouse destination cut off while its inner sink
    inserted rows it had taken (``outage`` mode, healthy: they never went to
    the spool): the inner sink counted them (``abandoned_rows``) but the
    spooling sink did not report them, so the destination's
    ``given_up_records`` stayed 0 and ShutdownAbandoned named no loss."""
    import uuid

    table = f"grace_spool_{uuid.uuid4().hex[:8]}"
    entered, release = threading.Event(), threading.Event()
    made: list[ClickHouseSink] = []
    factory = _spooling_clickhouse(
        chdb_transport, tmp_path / "spool", table, "outage", entered, release, made
    )
    runtime = _fan_out(factory, NullSink())
    try:
        _submit(runtime, 3, [])
        thread, _raised = _flush_in_thread(runtime)
        assert entered.wait(10)  # the flush waits for the inner sink's held insert
        with pytest.raises(ShutdownAbandoned) as caught:
            runtime.close(timeout=0.5)
        thread.join(10)
        (counters,) = made[0].table_counters().values()
        assert counters.abandoned_rows == 12
        held = runtime.counters().destinations["held"]
        assert (held.records, held.given_up_records) == (12, 12)
        assert caught.value.abandoned_records == {"held": 12}
    finally:
        release.set()


def test_rows_the_spool_keeps_through_a_cut_are_not_given_up(chdb_transport, tmp_path):
    """``always`` mode: every batch is in the spool before submit returns,
    and the drain's insert the cut abandoned leaves its group
    unacknowledged there.  Nothing is lost, so nothing is counted given up;
    the next start delivers all of it."""
    import uuid

    table = f"grace_kept_{uuid.uuid4().hex[:8]}"
    directory = tmp_path / "spool"
    entered, release = threading.Event(), threading.Event()
    made: list[ClickHouseSink] = []
    factory = _spooling_clickhouse(
        chdb_transport, directory, table, "always", entered, release, made
    )
    runtime = _fan_out(factory, NullSink())
    try:
        _submit(runtime, 3, [])
        assert entered.wait(10)  # the drain's insert waits
        with pytest.raises(ShutdownAbandoned):
            runtime.close(timeout=0.5)
        held = runtime.counters().destinations["held"]
        assert (held.records, held.given_up_records) == (12, 0)
    finally:
        release.set()
    again = threading.Event()
    again.set()  # the next start's inserts are not held
    restarted = _fan_out(
        _spooling_clickhouse(chdb_transport, directory, table, "always", entered, again, []),
        NullSink(),
    )
    restarted.flush(wait=True)
    restarted.close()
    rows = chdb_transport.query(f"SELECT count() AS n FROM `{table}`").column("n")[0].as_py()
    assert rows == 12


def test_an_owned_clickhouse_destination_lets_go_of_chdb_when_its_run_is_cancelled(
    chdb_transport,
):
    """The nursery running a routing sink cancelled, no shutdown, no cut: a
    ClickHouse destination it created was never closed nor released, so its
    chDB session stayed open for the life of the process (no other data
    directory could be opened).  Now the destination's run task lets go
    of it as it ends."""
    import uuid

    from taproute.routing import SinkClosed
    from taproute.service.sinks.clickhouse.transport import _SharedSession

    users = _SharedSession.users  # the fixture's transport on the same directory
    made: list[ClickHouseSink] = []
    table = f"cancel_release_{uuid.uuid4().hex[:8]}"
    sink = RoutingSink(
        RoutingConfig([Route("to_ch", "h.*", "ch")]),
        SCHEMA,
        {"ch": _embedded_clickhouse(chdb_transport, table, made)},
        unmatched="drop",
    )

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(sink.run)
            assert _SharedSession.users == users + 1
            nursery.cancel_scope.cancel()

    trio.run(main)
    (ch,) = made
    assert ch._calls.wait_released(0)
    assert _SharedSession.users == users
    with pytest.raises(SinkClosed):
        ch.check_tables()  # later calls are refused


@pytest.mark.parametrize("record_sink", ["routing sink", "clickhouse sink"])
def test_an_owned_clickhouse_sink_lets_go_of_chdb_when_the_runtime_loop_fails(
    chdb_transport, record_sink
):
    """A task on the runtime's loop failed, so the loop ended without closing
    its record sink: the ClickHouse sink the runtime ran (its record sink,
    or a destination its routing sink created) kept its chDB session.  Now
    it lets go of it as its run task ends."""
    import uuid

    from taproute.routing import RoutingFailure
    from taproute.service.sinks.clickhouse.transport import _SharedSession

    users = _SharedSession.users
    made: list[ClickHouseSink] = []
    factory = _embedded_clickhouse(chdb_transport, f"loop_release_{uuid.uuid4().hex[:8]}", made)
    if record_sink == "routing sink":
        sink: Any = RoutingSink(
            RoutingConfig([Route("to_ch", "h.*", "ch")]), SCHEMA, {"ch": factory}, unmatched="drop"
        )
    else:
        sink = factory()
    runtime = RecordRuntime(sink, schema=SCHEMA)
    fail = threading.Event()

    async def doomed(*, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await trio.to_thread.run_sync(fail.wait, 60)
        raise OSError("a loop task failed")

    runtime.host(doomed)
    runtime.start()
    (ch,) = made
    assert _SharedSession.users == users + 1
    fail.set()
    assert runtime._thread is not None
    runtime._thread.join(60)  # the loop ended, and no close reached the sink
    with pytest.raises(RoutingFailure, match="runtime loop failed: OSError: a loop task failed"):
        runtime.close(timeout=60)
    assert ch._calls.wait_released(0)
    assert _SharedSession.users == users


async def test_a_block_handed_back_to_the_spool_as_a_cut_comes_is_not_given_up(
    chdb_transport, tmp_path
):
    """A block whose insert failed is handed back to the spool; the spool
    writes its frame (a large one: in a worker thread) and, with
    ``fsync="batch"``, then syncs it.  A cut during the write let the frame
    be written and then raised at the sync's start: the inner sink counted
    the rows as given up (abandoned), although their frame was in the spool
    and the next start delivers them.  Now the frame's sync is finished and
    nothing is counted given up."""
    import uuid

    from taproute.service.sinks.spool import Spool, SpoolConfig
    from taproute.service.sinks.spool.spool import _INLINE_BYTES
    from taproute.service.sinks.spool.spooling import SpoolingSink
    from tests.conftest import vec_batch
    from tests.test_clickhouse_unreachable import hooks_with_q
    from tests.test_spool_close import spooled_records

    ch = _clickhouse_on(chdb_transport, f"handed_back_{uuid.uuid4().hex[:8]}")
    ch.use_hooks(hooks_with_q())

    def unreachable(*args: object) -> None:
        raise ConnectionRefusedError("the server is down")

    ch._insert_blocking = unreachable  # type: ignore[method-assign]
    directory = tmp_path / "spool"
    spool = Spool.open(SpoolConfig(directory=directory, fsync="batch"))
    sink = SpoolingSink("held", ch, spool, mode="outage")
    entered, release = threading.Event(), threading.Event()
    append = spool._log.append

    def held_append(*args: Any) -> Any:
        entered.set()
        release.wait()
        return append(*args)

    spool._log.append = held_append  # type: ignore[method-assign]
    records = _INLINE_BYTES // 16 + 1  # a frame over 2 MiB: written in a worker thread
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(sink.run)
            batch = vec_batch(0, records)
            await sink.submit(batch)  # healthy: into the inner sink's buffer
            batch.lease.release()
            nursery.start_soon(sink.flush)  # its insert fails: handed back to the spool
            await trio.to_thread.run_sync(entered.wait, 10)
            nursery.cancel_scope.cancel()  # a cut: the run task (and the flush) cancelled
            release.set()  # the frame is written after the cut came
    finally:
        release.set()
    await sink.release_when_cut()
    assert sink.given_up_records() == 0
    assert await spooled_records(directory) == records  # the next start finds them all


async def test_a_cancelled_close_of_a_spooling_sink_lets_go_of_its_spool(chdb_transport, tmp_path):
    """close() of a spooling destination cancelled while it waited for its
    inner sink's insert: its last step, closing the spool, was cancelled
    too, so the spool kept its files and its directory's lock (a restart in
    the process raised SpoolLocked).  Now a cancelled close still closes it."""
    import uuid

    from taproute.service.sinks.spool import Spool, SpoolConfig
    from tests.sinks import close_cancelled_while_inserting
    from tests.test_clickhouse_unreachable import hooks_with_q

    directory = tmp_path / "spool"
    entered, release = threading.Event(), threading.Event()
    table = f"spool_close_{uuid.uuid4().hex[:8]}"
    sink = _spooling_clickhouse(chdb_transport, directory, table, "outage", entered, release, [])()
    sink.use_hooks(hooks_with_q())
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(sink.run)
            assert await close_cancelled_while_inserting(sink, entered)
        again = Spool.open(SpoolConfig(directory=directory))  # raised SpoolLocked
        await again.aclose()
    finally:
        release.set()


def test_an_owned_clickhouse_destination_is_released_when_another_fails_to_open(chdb_transport):
    """The routing sink creates every owned destination before it starts
    any: when a later one's factory raised, those created before it were
    never run, closed nor released (the chDB session stayed open)."""
    import uuid

    from taproute.service.sinks.clickhouse.transport import _SharedSession

    users = _SharedSession.users
    made: list[ClickHouseSink] = []

    def refuses() -> NullSink:
        raise ConfigError("this destination cannot be built")

    sink = RoutingSink(
        RoutingConfig([Route("to_ch", "h.*", "ch"), Route("to_bad", "h.*", "bad")]),
        SCHEMA,
        {
            "ch": _embedded_clickhouse(chdb_transport, f"open_fails_{uuid.uuid4().hex[:8]}", made),
            "bad": refuses,
        },
        unmatched="drop",
    )
    with pytest.raises(ConfigError, match="cannot be built"):
        trio.run(sink.run)
    (ch,) = made
    assert ch._calls.wait_released(0)
    assert _SharedSession.users == users


def test_an_owned_sink_without_a_run_task_lets_go_when_the_routing_sink_run_is_cancelled():
    """An owned destination with no run() task of its own (a user's sink
    holding a connection) was let go of only by its close(): the routing
    sink's run cancelled without a close left it holding. Now the run's end
    asks it to let go (ReleasesWhenCut), once; a sink that was closed is
    not asked."""

    class Connected(NullSink):
        def __init__(self) -> None:
            super().__init__()
            self.released = 0

        async def release_when_cut(self) -> None:
            self.released += 1

    made: list[Connected] = []

    def connected() -> Connected:
        made.append(Connected())
        return made[-1]

    def routing() -> RoutingSink:
        return RoutingSink(
            RoutingConfig([Route("to_c", "h.*", "c")]), SCHEMA, {"c": connected}, unmatched="drop"
        )

    async def cancelled(sink: RoutingSink) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(sink.run)
            nursery.cancel_scope.cancel()

    async def closed(sink: RoutingSink) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(sink.run)
            await sink.close()

    trio.run(cancelled, routing())
    trio.run(closed, routing())
    assert [c.released for c in made] == [1, 0]
