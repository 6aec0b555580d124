"""A quick processor runs on the loop (no thread hop); a slow one, one that
needs a thread, or one past a slow call runs in worker threads."""

from __future__ import annotations

import math
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import trio

from taproute.actors import open_routing_sink
from taproute.actors.attempt import (
    INLINE_AFTER,
    INLINE_AFTER_MAX,
    INLINE_BELOW_S,
    INLINE_TRUSTED,
    INLINE_WALL_S,
    THREAD_WAIT_S,
    Placement,
    charged,
    timed_call,
)
from taproute.routing import HookRegistry, Records, Route, RoutingConfig, stateless_processor
from taproute.service import CaptureSink
from tests.conftest import vec_batch
from tests.processors import NORM, SCHEMA

CALLS: list[tuple[int, bool]] = []  # (thread ident, slow?) per call
SLOW = {"on": False}


def _rows(records: Records) -> np.ndarray:
    rows = np.zeros(len(records), dtype=NORM.dtype)
    rows["seq"] = records.descriptors["seq"]
    return rows


@stateless_processor("placement.probe", input="vec", output="norm")
def probe(records: Records) -> np.ndarray:
    slow = SLOW["on"]
    CALLS.append((threading.get_ident(), slow))
    if slow:
        time.sleep(2 * THREAD_WAIT_S)  # a call that waits: plainly not one for the loop
    return _rows(records)


@stateless_processor("placement.threaded", input="vec", output="norm", needs_thread=True)
def threaded(records: Records) -> np.ndarray:
    CALLS.append((threading.get_ident(), False))
    return _rows(records)


@stateless_processor("placement.nap", input="vec", output="norm")
def nap(records: Records) -> np.ndarray:
    CALLS.append((threading.get_ident(), False))
    time.sleep(0.003)  # a wait: an I/O call, say
    return _rows(records)


def _inline(place: Placement) -> Placement:
    for _ in range(INLINE_AFTER):
        place.took(INLINE_BELOW_S / 2)
    return place


def test_placement_goes_inline_after_quick_calls_only():
    place = Placement()
    for _ in range(INLINE_AFTER - 1):
        place.took(INLINE_BELOW_S / 2)
    assert not place.inline
    place.took(INLINE_BELOW_S * 2)  # not quick: the count starts again
    for _ in range(INLINE_AFTER - 1):
        place.took(INLINE_BELOW_S / 2)
    assert not place.inline
    place.took(INLINE_BELOW_S / 2)
    assert place.inline


def test_placement_leaves_the_loop_at_a_long_call_or_two_slower_ones():
    place = _inline(Placement())
    place.took(INLINE_BELOW_S * 2)  # once: forgiven (a preempted quick call)
    assert place.inline
    place.took(INLINE_BELOW_S / 2)
    place.took(INLINE_BELOW_S * 2)
    assert place.inline
    place.took(INLINE_BELOW_S * 2)  # twice in a row: back to threads
    assert not place.inline
    place = _inline(Placement())
    place.took(INLINE_WALL_S)  # waited, or grew: back at once
    assert not place.inline
    place = _inline(Placement())
    place.took(math.inf)  # raised, or abandoned at its deadline
    assert not place.inline


def test_a_trusted_processor_is_forgiven_one_long_call_then_earns_trust_again():
    place = Placement()
    for _ in range(INLINE_TRUSTED):
        place.took(INLINE_BELOW_S / 2)
    place.took(10 * INLINE_WALL_S)  # the loop thread descheduled mid-call: forgiven
    assert place.inline
    place.took(INLINE_BELOW_S / 2)
    place.took(10 * INLINE_WALL_S)  # trust spent: a second long call goes back at once
    assert not place.inline
    place = Placement()
    for _ in range(INLINE_TRUSTED):
        place.took(INLINE_BELOW_S / 2)
    place.took(10 * INLINE_WALL_S)
    place.took(INLINE_BELOW_S * 2)  # two slow calls in a row: back to threads
    assert not place.inline
    place = Placement()
    for _ in range(INLINE_TRUSTED):
        place.took(INLINE_BELOW_S / 2)
    place.took(math.inf)  # a failure is never forgiven
    assert not place.inline
    place = Placement()
    for _ in range(INLINE_TRUSTED - 1):
        place.took(INLINE_BELOW_S / 2)
    place.took(INLINE_WALL_S)  # one quick call short of trusted: back at once
    assert not place.inline


def _usage(cpu: float, voluntary: int) -> SimpleNamespace:
    return SimpleNamespace(ru_utime=cpu, ru_stime=0.0, ru_nvcsw=voluntary)


def test_a_preempted_call_is_charged_its_cpu_time_a_waiting_one_its_wall_time():
    # Preempted mid-call (no wait of its own): 0.1 ms of CPU over 9 ms of wall.
    assert charged(0.009, _usage(1.0, 5), _usage(1.0001, 5)) == pytest.approx(0.0001)
    # It waited (a voluntary switch: I/O, a lock, a sleep, the GIL): the wall time.
    assert charged(0.009, _usage(1.0, 5), _usage(1.0001, 6)) == 0.009
    # Never more than the wall time (getrusage counts in microseconds).
    assert charged(0.0005, _usage(1.0, 5), _usage(1.001, 5)) == 0.0005


def test_a_worker_thread_call_that_waited_briefly_is_charged_its_cpu_time():
    # A worker thread waits for the GIL while the loop or a producer holds it:
    # a quick call that waited so, within THREAD_WAIT_S, is charged its CPU time.
    brief = THREAD_WAIT_S / 2
    assert charged(brief, _usage(1.0, 5), _usage(1.0001, 7), in_thread=True) == pytest.approx(
        0.0001
    )
    # On the loop the same wait counts in full: the loop waited.
    assert charged(brief, _usage(1.0, 5), _usage(1.0001, 7)) == brief
    # A longer wait counts in full in a thread too.
    assert charged(THREAD_WAIT_S, _usage(1.0, 5), _usage(1.0001, 6), in_thread=True) == (
        THREAD_WAIT_S
    )


def test_each_trip_back_from_the_loop_doubles_the_quick_calls_needed_to_return():
    place = _inline(Placement())
    needed = []
    for _ in range(8):
        place.took(INLINE_WALL_S)  # caught waiting on the loop: back to threads
        assert not place.inline
        calls = 0
        while not place.inline:
            place.took(INLINE_BELOW_S / 2)
            calls += 1
        needed.append(calls)
    assert needed == [16, 32, 64, 128, 256, 512, 512, 512]
    assert needed[-1] == INLINE_AFTER_MAX


def test_quick_calls_on_the_loop_earn_the_doubling_back():
    place = _inline(Placement())
    place.took(math.inf)
    for _ in range(2 * INLINE_AFTER):
        place.took(INLINE_BELOW_S / 2)
    place.took(math.inf)
    assert place.after == 4 * INLINE_AFTER
    for _ in range(4 * INLINE_AFTER):  # back on the loop
        place.took(INLINE_BELOW_S / 2)
    for _ in range(INLINE_TRUSTED):  # quick there for a while: half is forgiven
        place.took(INLINE_BELOW_S / 2)
    assert place.after == 2 * INLINE_AFTER
    for _ in range(INLINE_TRUSTED):
        place.took(INLINE_BELOW_S / 2)
    assert place.after == INLINE_AFTER  # never below where it started
    for _ in range(INLINE_TRUSTED):
        place.took(INLINE_BELOW_S / 2)
    assert place.after == INLINE_AFTER and place.inline


def test_a_call_that_never_reached_the_loop_does_not_double_the_wait():
    place = Placement()
    for _ in range(3):
        place.took(INLINE_WALL_S)  # slow in threads: the count starts again, no more
    assert place.after == INLINE_AFTER


def test_a_processor_that_waits_a_little_is_caught_on_the_loop_ever_less_often():
    """A processor that sleeps 3 ms (an I/O wait, which in a worker thread
    looks like a wait for the GIL) gets to the loop now and then; each time
    it is caught there, it stays in threads twice as long."""
    loop_thread = threading.get_ident()
    out = trio.run(_run, "placement.nap", 300)
    assert len(out.rows("r")) == 1200
    on_loop = sum(ident == loop_thread for ident, _ in CALLS)
    # Without the doubling it would be back on the loop every INLINE_AFTER + 1
    # calls (33 times in 300); with it, at most once or twice per doubling.
    assert on_loop <= 10


def test_timed_call_charges_a_sleep_its_wall_time_and_busy_work_its_cpu_time():
    _, slept = timed_call(time.sleep, 2 * INLINE_WALL_S)
    assert slept >= 2 * INLINE_WALL_S  # a wait: plainly not a call for the loop

    def busy(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    _, spun = timed_call(busy, 2 * INLINE_WALL_S)
    assert spun >= 1.9 * INLINE_WALL_S  # CPU work counts in full, preempted or not
    place = _inline(Placement())
    place.took(spun)
    assert not place.inline


async def _run(processor: str, batches: int, slow_from: int | None = None) -> CaptureSink:
    CALLS.clear()
    SLOW["on"] = False
    hooks = HookRegistry()
    q = hooks.bind("q", layout="vec")
    out = CaptureSink()
    config = RoutingConfig([Route("r", "q", "out", mode="stateless", processor=processor)])
    async with open_routing_sink(config, SCHEMA, {"out": out}, "out", hooks=hooks) as sink:
        for i in range(batches):
            if i == slow_from:
                SLOW["on"] = True
            await sink.submit(vec_batch(q, 4, seq_start=4 * i))
            await sink.flush()  # one call at a time, in order
    return out


@pytest.fixture
def calls_timed_by_the_test(monkeypatch):
    """What these tests prove is the wiring (a call's time reaches the route's
    placement, which moves the route on and off the loop), not how fast this
    machine runs a trivial call: on a loaded 2-core machine a preempted quick
    call can measure over the bound, so a quick call's time is taken as 0 and a
    slow one (SLOW on) keeps its real, long wall time."""

    def timed(fn, *args, in_thread=False):
        result, elapsed = timed_call(fn, *args, in_thread=in_thread)
        return result, (elapsed if SLOW["on"] else 0.0)

    monkeypatch.setattr("taproute.actors.attempt.timed_call", timed)


@pytest.mark.usefixtures("calls_timed_by_the_test")
def test_a_quick_processor_moves_onto_the_loop_and_off_it_when_slow():
    loop_thread = threading.get_ident()  # trio.run runs the loop in this thread
    out = trio.run(_run, "placement.probe", 180, 150)
    assert len(out.rows("r")) == 720  # every record processed, wherever it ran
    quick = [ident == loop_thread for ident, slow in CALLS if not slow]
    assert not any(quick[:INLINE_AFTER])  # the first calls always go to threads
    assert any(quick)  # then some ran on the loop
    slow = [ident == loop_thread for ident, slow in CALLS if slow]
    # After one long call (two, when the first was forgiven a trusted processor): threads.
    assert slow[2:] == [False] * (len(slow) - 2)


def test_a_processor_that_needs_a_thread_never_runs_on_the_loop():
    loop_thread = threading.get_ident()
    out = trio.run(_run, "placement.threaded", 3 * INLINE_AFTER)
    assert len(out.rows("r")) == 12 * INLINE_AFTER
    assert all(ident != loop_thread for ident, _ in CALLS)


@pytest.mark.usefixtures("calls_timed_by_the_test")
def test_a_quick_predicate_moves_onto_the_loop():
    loop_thread = threading.get_ident()
    seen: list[int] = []

    def even_seq(descriptors):
        seen.append(threading.get_ident())
        return descriptors["seq"] % 2 == 0

    async def main() -> CaptureSink:
        hooks = HookRegistry()
        q = hooks.bind("q", layout="vec")
        out = CaptureSink()
        config = RoutingConfig([Route("r", "q", "out", predicate=even_seq)])
        async with open_routing_sink(
            config, SCHEMA, {"out": out}, unmatched="drop", hooks=hooks
        ) as sink:
            for i in range(100):
                await sink.submit(vec_batch(q, 4, seq_start=4 * i))
                await sink.flush()
        return out

    out = trio.run(main)
    assert sum(len(b) for b in out.batches) == 200  # the even seqs, wherever it ran
    on_loop = [ident == loop_thread for ident in seen]
    assert not any(on_loop[:INLINE_AFTER]) and any(on_loop)


def test_stateless_thread_calls_are_judged_by_cpu_stateful_ones_by_wall(monkeypatch):
    """A stateless processor's worker-thread calls that waited briefly are
    charged their CPU time (so it returns to the loop under load); a stateful
    one's are charged their wall time: under load its owners group queued
    batches into one thread hop (one_hop.py), which the loop would give up."""
    from taproute.actors import attempt

    used: list[tuple[str, bool]] = []
    original = attempt.prepared_call

    def recording(prepare, fn, *args, in_thread=False):
        used.append((getattr(fn, "__name__", "?"), in_thread))
        return original(prepare, fn, *args, in_thread=in_thread)

    monkeypatch.setattr(attempt, "prepared_call", recording)

    async def main() -> None:
        hooks = HookRegistry()
        q = hooks.bind("q", layout="vec")
        config = RoutingConfig(
            [
                Route("n", "q", "out", mode="stateless", processor="test.norms"),
                Route("s", "q", "sums", mode="stateful", processor="test.running_sum"),
            ]
        )
        sinks = {"out": CaptureSink(), "sums": CaptureSink()}
        async with open_routing_sink(config, SCHEMA, sinks, unmatched="drop", hooks=hooks) as sink:
            for i in range(3):  # first calls: worker threads, for both
                await sink.submit(vec_batch(q, 4, seq_start=4 * i))
                await sink.flush()

    trio.run(main)
    assert {in_thread for name, in_thread in used if name == "norms"} == {True}
    assert {in_thread for name, in_thread in used if name == "running_sum"} == {False}
