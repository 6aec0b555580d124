"""Configuration generations and live reload of a routing sink (issue #15).

A reload builds the next generation beside the running one and swaps it in
at a batch boundary: batches accepted before finish under their generation,
later ones route under the new one; a failed build changes nothing and lists
every problem; parked records are retried at once under the new generation,
or fail ``handler_missing`` when it no longer runs their processor.
"""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import trio

from taproute.actors import open_routing_sink
from taproute.routing import (
    FailureCode,
    FailurePolicy,
    HookRegistry,
    PlanErrors,
    RecordFailure,
    Route,
    RoutingConfig,
    stateless_processor,
)
from taproute.routing.records import Records
from taproute.service import CaptureSink, DeadLetterStore
from tests.conftest import one_route_sink, vec_batch
from tests.failing_processors import SCRIPT
from tests.processors import SCHEMA, norms

Q = "layers.0.q"
OTHER = "layers.0.unrouted"
#: Retries far in the future: a retry seen before the clock gets there was a reload's.
SLOW_RETRY = FailurePolicy(deadline=0, initial_backoff=1000.0, max_backoff=1000.0)

GATE = threading.Event()
STARTED = threading.Event()


@stateless_processor("reload.gated_norms", input="vec", output="norm")
def gated_norms(records: Records) -> np.ndarray:
    """test.norms, once the test opens the gate (it says when a call started)."""
    STARTED.set()
    GATE.wait(30)
    return norms(records)


@pytest.fixture(autouse=True)
def fresh_script():
    SCRIPT.reset()
    GATE.clear()
    STARTED.clear()
    yield
    GATE.set()


def hooks_with_q() -> tuple[HookRegistry, int]:
    hooks = HookRegistry()
    return hooks, hooks.bind(Q, layout="vec")


def forward(destination: str) -> RoutingConfig:
    return RoutingConfig([Route("r", Q, destination)])


async def test_a_reload_swaps_routes_between_batches():
    hooks, q = hooks_with_q()
    a, b = CaptureSink(), CaptureSink()
    async with open_routing_sink(
        forward("a"), SCHEMA, {"a": a, "b": b}, unmatched="drop", hooks=hooks
    ) as sink:
        assert sink.snapshot().generation == 1
        assert sink.trace(Q).generation == 1
        await sink.submit(vec_batch(q, 3))
        assert await sink.reload(forward("b")) == 2
        await sink.submit(vec_batch(q, 2, seq_start=100))
        await sink.flush()
        snap = sink.snapshot()
        assert snap.generation == 2
        assert sink.trace(Q).destinations == ["b"]
        assert sink.trace(Q).generation == 2
    assert a.descriptors()["seq"].tolist() == [0, 1, 2]
    assert b.descriptors()["seq"].tolist() == [100, 101]
    # The route's destination changed: its counters are the new route's own.
    assert snap.routes["r"].processed == 2


async def test_records_accepted_before_a_reload_finish_under_their_generation():
    hooks, q = hooks_with_q()
    old, new = CaptureSink(), CaptureSink()

    def norms_route(processor: str, destination: str) -> RoutingConfig:
        route = Route(
            "n", Q, destination, mode="stateless", processor=processor, failure_policy=SLOW_RETRY
        )
        return RoutingConfig([route])

    async with open_routing_sink(
        norms_route("reload.gated_norms", "old"),
        SCHEMA,
        {"old": old, "new": new},
        unmatched="drop",
        hooks=hooks,
    ) as sink:
        await sink.submit(vec_batch(q, 3))
        await sink.submit(vec_batch(q, 2, seq_start=10))  # queued behind the running call
        await trio.to_thread.run_sync(STARTED.wait)  # generation 1's processor is running
        assert await sink.reload(norms_route("test.norms", "new")) == 2
        await sink.submit(vec_batch(q, 4, seq_start=100))
        GATE.set()
        await sink.flush()
        counters = sink.snapshot().routes["n"]
    # Accepted under generation 1 (one in its processor, one in its mailbox):
    # processed by generation 1's route, into its destination.
    assert sorted(old.rows("n")["seq"].tolist()) == [0, 1, 2, 10, 11]
    assert new.rows("n")["seq"].tolist() == [100, 101, 102, 103]
    assert counters.processed == 4  # the new route's own (another destination)


async def test_a_failed_reload_keeps_the_old_generation_and_lists_every_problem():
    hooks, q = hooks_with_q()
    a = CaptureSink()
    async with open_routing_sink(
        forward("a"), SCHEMA, {"a": a}, unmatched="drop", hooks=hooks
    ) as sink:
        bad = RoutingConfig(
            [
                Route("ok", Q, "a"),
                Route("p", Q, "a", mode="stateless", processor="no.such.processor"),
                Route("d", Q, "nowhere"),
            ]
        )
        with pytest.raises(PlanErrors) as caught:
            await sink.reload(bad)
        located = caught.value.located()
        assert [where for _, where in located] == ["routes[1]", "routes[2]"]
        assert "no.such.processor" in located[0][0]
        assert "nowhere" in located[1][0]
        assert sink.snapshot().generation == 1
        await sink.submit(vec_batch(q, 2))
        await sink.flush()
        assert list(sink.snapshot().routes) == ["r"]
    assert a.records == 2


def by_seq_route(processor: str = "fail.by_seq", **kw: object) -> Route:
    return Route(
        "n",
        Q,
        "out",
        mode="stateless",
        processor=processor,
        failure_policy=SLOW_RETRY,
        **kw,  # type: ignore[arg-type]
    )


async def test_parked_records_are_retried_at_once_under_the_new_generation(mock_clock):
    """The clock stands still: a retry 1000 s away never falls due, so the
    record can only be processed because the reload retried it."""
    hooks, q = hooks_with_q()
    out = CaptureSink()
    failures: list[RecordFailure] = []
    SCRIPT.transient_seqs.update({1: 1})
    async with one_route_sink(by_seq_route(), out, hooks=hooks, on_failure=failures.append) as sink:
        await sink.submit(vec_batch(q, 1, seq_start=1))
        await sink.flush()
        assert sink.snapshot().routes["n"].parked == 1  # waiting 1000 s for its retry
        await sink.reload(RoutingConfig([by_seq_route(workers=2)]))
        await sink.flush()
        counters = sink.snapshot().routes["n"]
    assert out.rows("n")["seq"].tolist() == [1]
    assert counters.parked == 0 and counters.retries == 1 and counters.recovered == 1
    assert failures == []


@pytest.mark.parametrize(
    ("new_routes", "why"),
    [
        ([], "the route is not in it"),
        ([by_seq_route("test.norms")], "the route now runs 'test.norms'"),
    ],
)
async def test_a_record_parked_under_a_processor_no_longer_run_fails_handler_missing(
    mock_clock, tmp_path, new_routes, why
):
    hooks, q = hooks_with_q()
    out = CaptureSink()
    SCRIPT.transient_seqs.update({7: 1})
    store = DeadLetterStore(tmp_path / "dead.sqlite", hooks=hooks)
    async with one_route_sink(by_seq_route(), out, hooks=hooks, on_failure=store.handle) as sink:
        await sink.submit(vec_batch(q, 1, seq_start=7))
        await sink.flush()
        assert sink.snapshot().routes["n"].parked == 1
        await sink.reload(RoutingConfig(new_routes))
        await sink.flush()
    [letter] = store.list()
    store.close()
    assert letter.code == FailureCode.HANDLER_MISSING.value == "handler_missing"
    assert letter.route == "n" and letter.processor == "fail.by_seq"
    assert letter.seq == 7 and letter.generation == 2
    assert why in letter.error and "generation 2" in letter.error
    assert out.records == 0 and not out.row_batches()


def keyed_route(workers: int = 1) -> Route:
    return Route(
        "s",
        Q,
        "out",
        mode="stateful",
        processor="fail.keyed_log",
        workers=workers,
        failure_policy=SLOW_RETRY,
    )


async def test_a_stateful_route_keeps_its_state_and_key_order_across_a_reload(mock_clock):
    """A key held behind its failing head is taken over by the new generation's
    owners (4 instead of 1) and retried at once, ahead of its later records;
    the state and key lifecycle carry over."""
    hooks, q = hooks_with_q()
    out = CaptureSink()
    SCRIPT.failures_left.update({3: 1})
    keys = np.array([3, 3, 4, 3, 4])
    async with open_routing_sink(
        RoutingConfig([keyed_route(1)]),
        SCHEMA,
        {"out": out},
        unmatched="drop",
        hooks=hooks,
    ) as sink:
        for i, key in enumerate(keys.tolist()):  # one record per batch: key 3 fails first
            await sink.submit(vec_batch(q, 1, keys=np.array([key]), seq_start=i))
        await sink.flush()
        assert sink.snapshot().routes["s"].parked == 3  # key 3's head and the two behind it
        await sink.reload(RoutingConfig([keyed_route(4)]))
        await sink.submit(vec_batch(q, 2, keys=np.array([3, 4]), seq_start=10))
        await sink.flush()  # the clock stands still: only the reload retried key 3
        counters = sink.snapshot().routes["s"]
        assert sink.snapshot().generation == 2
    per_key: dict[int, list[int]] = {}
    for key, seq in SCRIPT.log:
        per_key.setdefault(key, []).append(seq)
    assert per_key == {3: [0, 1, 3, 10], 4: [2, 4, 11]}
    assert counters.parked == 0 and counters.valid_slots == 2
    assert counters.processed == 7  # counted across both generations (same labels)


# -- under load --------------------------------------------------------------------


def load_configs() -> list[RoutingConfig]:
    """Generations the load test cycles through: the same route names, changing
    workers, deadlines and the stateless route's processor (fail.by_seq <->
    test.norms: records parked under fail.by_seq then fail handler_missing)."""
    raw = Route("raw", Q, "raw")
    configs = []
    for i, (processor, workers) in enumerate(
        [("fail.by_seq", 1), ("fail.by_seq", 3), ("test.norms", 2), ("fail.by_seq", 2)]
    ):
        policy = FailurePolicy(
            deadline=0, initial_backoff=5.0 + i, max_failures=3, failure_window=0
        )
        configs.append(
            RoutingConfig(
                [
                    raw,
                    Route(
                        "norms",
                        Q,
                        "norms",
                        mode="stateless",
                        processor=processor,
                        workers=workers,
                        failure_policy=policy,
                    ),
                    Route(
                        "sums",
                        Q,
                        "sums",
                        mode="stateful",
                        processor="fail.keyed_log",
                        workers=(i % 3) + 1,
                        failure_policy=policy,
                    ),
                ]
            )
        )
    return configs


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_reloads_under_load_lose_and_duplicate_nothing(autojump_clock, seed):
    """in = delivered + dead-lettered + counted-dropped, per route, with no
    record twice, while a reloader swaps generations under a busy producer."""
    rng = random.Random(seed)
    hooks, q = hooks_with_q()
    other = hooks.bind(OTHER, layout="vec")
    raw, norm_rows, sum_rows = CaptureSink(), CaptureSink(), CaptureSink()
    dead: dict[str, list[int]] = {"raw": [], "norms": [], "sums": []}
    codes: set[str] = set()
    generations: set[int] = set()

    def on_failure(failure: RecordFailure) -> None:
        dead[failure.route] += failure.records.descriptors["seq"].tolist()
        codes.add(failure.code.value)
        assert failure.generation is not None
        generations.add(failure.generation)

    batches, size = 60, 8
    total = batches * size
    SCRIPT.bad_seqs.update(rng.sample(range(total), 6))
    SCRIPT.transient_seqs.update({s: rng.randint(1, 4) for s in rng.sample(range(total), 30)})
    SCRIPT.failures_left.update({k: rng.randint(1, 4) for k in rng.sample(range(16), 5)})
    configs = load_configs()
    dropped = 0
    async with open_routing_sink(
        configs[0],
        SCHEMA,
        {"raw": raw, "norms": norm_rows, "sums": sum_rows},
        unmatched="drop",
        hooks=hooks,
        on_failure=on_failure,
    ) as sink:

        async def produce() -> None:
            nonlocal dropped
            for b in range(batches):
                keys = np.array([rng.randrange(16) for _ in range(size)])
                await sink.submit(vec_batch(q, size, keys=keys, seq_start=b * size))
                if rng.random() < 0.3:
                    await sink.submit(vec_batch(other, 2, seq_start=10_000 + b * 2))
                    dropped += 2
                await trio.lowlevel.checkpoint()

        async def reload() -> None:
            for i in range(1, 13):
                await sink.reload(configs[i % len(configs)])
                for _ in range(rng.randrange(1, 6)):
                    await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(produce)
            nursery.start_soon(reload)
        await sink.flush()
        snap = sink.snapshot()
        assert snap.generation == 13
    # Closed: what was still parked (in backoff, or behind a failing key) was
    # given up at close, so every record is delivered or dead-lettered by now.
    everything = list(range(total))
    delivered = {
        "raw": raw.descriptors()["seq"].tolist(),
        "norms": norm_rows.rows("norms")["seq"].tolist(),
        "sums": sum_rows.rows("sums")["seq"].tolist(),
    }
    for route in ("raw", "norms", "sums"):
        seen = delivered[route] + dead[route]
        assert len(seen) == len(set(seen)), f"{route}: a record twice"
        assert sorted(seen) == everything, f"{route}: in != delivered + dead-lettered"
    assert snap.unmatched_dropped == dropped
    # policy_invalid: records still waiting behind a failing key when the sink closed.
    assert codes <= {"handler_missing", "handler_failed", "handler_invalid", "policy_invalid"}
    assert generations <= set(range(1, 14))
    # One key's records were processed in arrival order, whatever the generation.
    per_key: dict[int, list[int]] = {}
    for key, seq in SCRIPT.log:
        per_key.setdefault(key, []).append(seq)
    assert all(seqs == sorted(seqs) for seqs in per_key.values())


# -- chains across a reload --------------------------------------------------------


async def test_a_reload_keeps_the_limits_of_roots_in_flight_pinned(mock_clock):
    """One sink, two generations: a root whose first derived record was accepted
    under generation 1's limits keeps them; a new root gets generation 2's."""
    import tests.chain_processors  # noqa: F401 - registers chain.spray
    from taproute.routing import RecordBatch
    from taproute.routing.causal import CausalLimits

    hooks, q = hooks_with_q()
    fanout = CaptureSink()

    def config(per_minute: int) -> RoutingConfig:
        spray = Route(
            "spray", Q, "rows", mode="stateless", processor="chain.spray", failure_policy=SLOW_RETRY
        )
        return RoutingConfig(
            [spray, Route("fanout", "route:spray", "fanout")],
            causal_limits=CausalLimits(per_root_per_minute=per_minute),
        )

    pinned = vec_batch(q, 1, keys=[1])
    fresh = vec_batch(q, 1, keys=[2])

    def copy(batch: RecordBatch) -> RecordBatch:
        return RecordBatch.from_buffer(batch.descriptors, batch.payload)

    async with open_routing_sink(
        config(10),
        SCHEMA,
        {"rows": CaptureSink(), "fanout": fanout},
        unmatched="drop",
        hooks=hooks,
        causal_clock=trio.current_time,
    ) as sink:
        await sink.submit(copy(pinned))
        await sink.flush()
        assert fanout.records == 10
        mock_clock.jump(60)  # the next UTC minute: rate capacity is back
        assert await sink.reload(config(50)) == 2
        await sink.submit(copy(pinned))
        await sink.flush()
        assert fanout.records == 10 + 10  # the root in flight keeps its 10 per minute
        await sink.submit(copy(fresh))
        await sink.flush()
        assert fanout.records == 10 + 10 + 50  # a new root gets the new generation's
        snap = sink.snapshot()
    assert snap.causal.pinned_roots == 2 and snap.generation == 2
    assert snap.causal.limits == CausalLimits(per_root_per_minute=50)
    fanout.clear()


@pytest.mark.parametrize("workers", [1, 3])
async def test_a_flush_after_reloading_a_stateful_route_with_a_record_due_for_retry_returns(
    workers,
):
    """A record parked with its retry already due when a reload retires its
    route: the next flush paused retries, then waited for the retired route to
    hand over, which it does only once it drained, its due retry included, so
    the flush never returned.  It now waits for such handovers first."""
    SCRIPT.failures_left.update({1: 1})
    hooks = HookRegistry()
    q = hooks.bind("layers.0.q", layout="vec")
    out = CaptureSink()
    route = Route(
        "keyed",
        "layers.0.q",
        "out",
        mode="stateful",
        processor="fail.keyed_log",
        workers=workers,
        failure_policy=FailurePolicy(deadline=0, initial_backoff=0),
    )
    with trio.fail_after(30):
        async with open_routing_sink(
            RoutingConfig([route]), SCHEMA, {"out": out}, unmatched="drop", hooks=hooks
        ) as sink:
            await sink.submit(vec_batch(q, 1, keys=[1]))
            await sink.submit(vec_batch(q, 2, keys=[1, 2], seq_start=1))  # key 1's waits
            await sink.flush()
            await sink.reload(RoutingConfig([route]))
            report = await sink.flush()
            assert report.routes["keyed"].delivered == 3
    assert [entry for entry in SCRIPT.log if entry[0] == 1] == [(1, 0), (1, 1)]  # in order
    assert sorted(SCRIPT.log) == [(1, 0), (1, 1), (2, 2)]
