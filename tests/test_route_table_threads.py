"""Hooks bound from several producer threads at once all reach the route table.

``HookRegistry.bind`` calls its listeners (a generation's ``RouteTable.assign``)
outside its lock, so two producer threads binding new hooks run ``assign`` at
the same time.  ``assign`` grows the output_id table by copying it and interns
route sets by appending to arrays, in steps between which numpy's Python-level
helpers let another thread run: one thread's grown copy replaced the other's
(its assignment lost: records of that hook went unmatched), or a copy of the
other's larger array raised ``could not broadcast``.  Bounded and deterministic
enough: a short switch interval makes the interleaving likely in every round,
and it was lost in about a third of the rounds before ``assign`` took a lock.
"""

from __future__ import annotations

import sys
import threading

import pytest

from taproute.native import RouteTable
from taproute.routing.hooks import HookRegistry

THREADS = 4
HOOKS = 1200  # past the table's 64 -> 128 -> ... -> 2048 growth steps
ROUNDS = 40


@pytest.fixture
def switch_often():
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def routes_for(name: str) -> tuple[int, ...]:
    thread = int(name.split(".")[1])
    return (thread, THREADS + thread)


def bind_at_once() -> tuple[HookRegistry, RouteTable, list[BaseException]]:
    """``THREADS`` producers, released together by a barrier, each binding its
    share of ``HOOKS`` new hooks into a registry a route table follows."""
    hooks = HookRegistry()
    table = RouteTable(2 * THREADS)
    hooks.subscribe(lambda name, output_id: table.assign(output_id, routes_for(name)))
    barrier = threading.Barrier(THREADS)
    failures: list[BaseException] = []

    def producer(thread: int) -> None:
        barrier.wait()
        try:
            for i in range(HOOKS // THREADS):
                hooks.bind(f"t.{thread}.h{i}")
        except BaseException as exc:
            failures.append(exc)

    workers = [threading.Thread(target=producer, args=(t,)) for t in range(THREADS)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
    return hooks, table, failures


def test_concurrent_bindings_are_all_assigned_in_the_route_table(switch_often):
    for round_ in range(ROUNDS):
        hooks, table, failures = bind_at_once()
        assert not failures, f"round {round_}: bind raised {failures[0]!r}"
        assert len(hooks.names()) == HOOKS
        wrong = [
            (name, table.routes_of(output_id))
            for output_id, name in enumerate(hooks.names())
            if table.routes_of(output_id) != routes_for(name)
        ]
        assert not wrong, f"round {round_}: {len(wrong)} bindings lost, e.g. {wrong[:3]}"
