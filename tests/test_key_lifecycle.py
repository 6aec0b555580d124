"""Key lifecycle on stateful routes: complete / cancel / reopen, terminal keys."""

from __future__ import annotations

import threading
import time

import numpy as np
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from taproute.actors import open_routing_sink
from taproute.routing import (
    Failed,
    FailureCode,
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

Q = "model.layers.0.attn.q"
KEYS = 8

#: seqs whose first processing fails transiently (so their key is held behind them)
FLAKY: set[int] = set()
FAILED_ONCE: set[int] = set()
FLAKY_LOCK = threading.Lock()
#: set by a test to hold the processor until it is released
GATE = {"entered": threading.Event(), "go": threading.Event(), "on": False}


def _seq_total(state, key: int) -> np.ndarray:
    rows = np.zeros(1, dtype=SUM.dtype)
    rows["key"] = key
    rows["total"][0, :2] = state.slots[key]
    rows["count"] = int(state.slots[key, 1])
    return rows


@stateful_processor(
    "test.lifecycle_seq_sum",
    key=lambda d: d["key"],
    key_range=KEYS,
    slot=SlotSpec((2,), "float64"),
    input="vec",
    output="sum",
    finalize=_seq_total,
)
def seq_sum(records: Records, keys: np.ndarray, state) -> Failed | None:
    """Per key: sum of seqs (slot[0]) and count (slot[1]); rows only at finalize."""
    seqs = records.descriptors["seq"]
    if GATE["on"]:
        GATE["entered"].set()
        GATE["go"].wait(60)
    with FLAKY_LOCK:
        fresh = [s for s in seqs.tolist() if s in FLAKY and s not in FAILED_ONCE]
        if fresh:
            FAILED_ONCE.update(fresh)
            return Failed("flaky")
    np.add.at(state.slots[:, 0], keys, seqs.astype(np.float64))
    np.add.at(state.slots[:, 1], keys, 1)
    return None


def _config(*, workers: int = 1, capacity: int = 64, terminal: str = "drop") -> RoutingConfig:
    policy = FailurePolicy(deadline=0, initial_backoff=1.0, terminal_records=terminal)
    return RoutingConfig(
        [
            Route(
                "life",
                Q,
                "out",
                mode="stateful",
                processor="test.lifecycle_seq_sum",
                workers=workers,
                capacity=capacity,
                failure_policy=policy,
            )
        ]
    )


def _hooks() -> tuple[HookRegistry, int]:
    hooks = HookRegistry()
    return hooks, hooks.bind(Q, layout="vec")


def _final_rows(out: CaptureSink) -> list[tuple[int, float, int]]:
    rows = [b.rows for b in out.batches if hasattr(b, "rows")]
    if not rows:
        return []
    all_rows = np.concatenate(rows)
    return [(int(r["key"]), float(r["total"][0]), int(r["count"])) for r in all_rows]


# -- complete behind queued input equals a reference model ---------------------------

op = st.one_of(
    st.tuples(st.just("submit"), st.lists(st.integers(0, KEYS - 1), min_size=1, max_size=6)),
    st.tuples(st.sampled_from(["complete", "cancel", "reopen"]), st.integers(0, KEYS - 1)),
    st.tuples(st.just("yield"), st.integers(0, 3)),
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=st.lists(op, max_size=40), workers=st.integers(1, 3), flaky=st.sets(st.integers(0, 80)))
def test_complete_behind_queued_input_equals_reference_model(ops, workers, flaky):
    FLAKY.clear()
    FLAKY.update(flaky)
    FAILED_ONCE.clear()
    GATE["on"] = False
    hooks, q = _hooks()
    out = CaptureSink()

    # The reference: every operation applied at once, in call order.
    expected: list[tuple[int, float, int]] = []
    sums: dict[int, list[float]] = {}
    ended: set[int] = set()
    terminal = submitted = 0
    seq = 0
    for kind, arg in ops:
        if kind == "submit":
            for key in arg:
                submitted += 1
                if key in ended:
                    terminal += 1
                else:
                    total = sums.setdefault(key, [0.0, 0])
                    total[0] += seq
                    total[1] += 1
                seq += 1
        elif kind == "complete" and arg not in ended:
            if arg in sums:
                expected.append((arg, *sums.pop(arg)))  # type: ignore[arg-type]
            ended.add(arg)
        elif kind == "cancel":
            sums.pop(arg, None)
            ended.add(arg)
        elif kind == "reopen":
            ended.discard(arg)

    async def main() -> None:
        async with open_routing_sink(
            _config(workers=workers, capacity=3), SCHEMA, {"out": out}, "out", hooks=hooks
        ) as sink:
            start = 0
            for kind, arg in ops:
                if kind == "submit":
                    await sink.submit(vec_batch(q, len(arg), keys=arg, seq_start=start))
                    start += len(arg)
                elif kind == "yield":
                    for _ in range(arg):
                        await trio.sleep(0)
                else:
                    await getattr(sink, kind)(arg)
            await sink.flush()

            def settled() -> bool:
                now = sink.snapshot().routes["life"]
                done = now.processed + now.cancelled_records + now.terminal_records
                return now.parked == 0 and done == submitted

            # flush() does not wait for retries in backoff (documented): let them
            # fall due on the mock clock. A retry leaves `parked` before it is
            # processed, so parked == 0 alone can pass between the two; wait for
            # the accounting too. The bound is real time, not mock time: the
            # processor runs in a worker thread, and while it runs the autojump
            # clock jumps at every idle moment, so a mock-time bound fails a slow
            # (loaded, 2-core CI) machine rather than a lost record.
            give_up = time.monotonic() + 60
            while not settled():
                assert time.monotonic() < give_up, sink.snapshot().routes["life"]
                await trio.sleep(1)
            await sink.flush()
            route = sink.snapshot().routes["life"]
            assert route.terminal_records == terminal
            assert route.processed + route.cancelled_records + terminal == submitted
            assert route.parked == 0 and route.failed == 0

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    got = sorted(_final_rows(out))
    assert got == sorted(expected)


# -- cancel mid-stream -------------------------------------------------------------


async def test_cancel_discards_queued_records_and_releases_their_buffers(release_log):
    FLAKY.clear()
    hooks, q = _hooks()
    out = CaptureSink()
    GATE["entered"].clear()
    GATE["go"].clear()
    GATE["on"] = True
    try:
        async with open_routing_sink(_config(), SCHEMA, {"out": out}, "out", hooks=hooks) as sink:
            first = vec_batch(q, 2, keys=[3, 3], release=release_log.callback("first"))
            await sink.submit(first)
            first.lease.release()  # the submitter's own hold
            await trio.to_thread.run_sync(GATE["entered"].wait)  # the owner is inside it
            for i, name in enumerate(("second", "third")):
                batch = vec_batch(
                    q, 3, keys=[3, 3, 5], seq_start=10 * (i + 1), release=release_log.callback(name)
                )
                await sink.submit(batch)
                batch.lease.release()
            await sink.cancel(3)
            await sink.submit(vec_batch(q, 2, keys=[3, 5], seq_start=40))  # after the cancel
            GATE["go"].set()
            await sink.flush()
            route = sink.snapshot().routes["life"]
            assert route.processed == 2 + 2 + 1  # first; key 5 of second, third; the last 5
            assert route.cancelled_records == 4  # key 3 of second and third
            assert route.terminal_records == 1  # key 3 after the cancel
            assert route.cancelled_keys == 1 and route.completed_keys == 0
            assert release_log.calls == {"first": 1, "second": 1, "third": 1}
            await sink.complete(5)
            await sink.flush()
            # key 5: seqs 12, 22 and 41; key 3 was cancelled: no finalize, slot cleared
            assert _final_rows(out) == [(5, 12.0 + 22.0 + 41.0, 3)]
            assert sink.snapshot().routes["life"].valid_slots == 0
    finally:
        GATE["on"] = False
        GATE["go"].set()


# -- terminal keys -------------------------------------------------------------------


async def test_terminal_records_are_counted_dead_lettered_by_policy_and_reopen_reuses():
    FLAKY.clear()
    hooks, q = _hooks()
    out = CaptureSink()
    failures: list[RecordFailure] = []
    async with open_routing_sink(
        _config(terminal="dead_letter"),
        SCHEMA,
        {"out": out},
        "out",
        hooks=hooks,
        on_failure=failures.append,
    ) as sink:
        await sink.submit(vec_batch(q, 2, keys=[2, 2]))  # seqs 0, 1
        await sink.complete(2)
        await sink.submit(vec_batch(q, 3, keys=[2, 2, 4], seq_start=5))
        await sink.flush()
        route = sink.snapshot().routes["life"]
        assert route.terminal_records == 2 and route.completed_keys == 1
        assert route.finalize_rows == 1 and route.processed == 3
        assert [f.code for f in failures] == [FailureCode.KEY_TERMINAL]
        assert len(failures[0].records) == 2 and "reopen" in str(failures[0].error)
        await sink.reopen(2)
        await sink.submit(vec_batch(q, 1, keys=[2], seq_start=9))
        await sink.complete(2, 4)
        await sink.flush()
        assert sorted(_final_rows(out)) == [(2, 1.0, 2), (2, 9.0, 1), (4, 7.0, 1)]
        route = sink.snapshot().routes["life"]
        assert route.open_keys == 0 and route.valid_slots == 0
        assert route.completed_keys == 3 and route.oldest_open_key_age_s is None


async def test_oldest_open_key_age_shows_a_leaked_key(autojump_clock):
    hooks, q = _hooks()
    async with open_routing_sink(
        _config(), SCHEMA, {"out": CaptureSink()}, "out", hooks=hooks
    ) as sink:
        await sink.submit(vec_batch(q, 1, keys=[1]))
        await sink.flush()
        await trio.sleep(30)
        await sink.submit(vec_batch(q, 1, keys=[6]))
        await sink.flush()
        await trio.sleep(5)
        route = sink.snapshot().routes["life"]
        assert route.open_keys == 2
        assert route.oldest_open_key_age_s is not None
        assert abs(route.oldest_open_key_age_s - 35.0) < 1.0
        await sink.complete(1)
        await sink.flush()
        route = sink.snapshot().routes["life"]
        assert route.open_keys == 1 and abs(route.oldest_open_key_age_s - 5.0) < 1.0
