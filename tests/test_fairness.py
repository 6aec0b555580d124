"""A processor call made on the loop is followed by a schedule point, except in
a task that marked one less than YIELD_AFTER_S ago (the record worker, just
woken for a lone batch): it saves a scheduler pass per batch and still hands
the loop over during a burst."""

from __future__ import annotations

import trio

from taproute.actors import fairness


class _Steps(trio.abc.Instrument):
    """Counts the steps one task takes: a schedule point ends a step."""

    def __init__(self, task: trio.lowlevel.Task) -> None:
        self.task = task
        self.steps = 0

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if task is self.task:
            self.steps += 1


async def _spied(call) -> int:
    """How many schedule points ``call()`` passed in the calling task."""
    steps = _Steps(trio.lowlevel.current_task())
    trio.lowlevel.add_instrument(steps)
    try:
        await call()
    finally:
        trio.lowlevel.remove_instrument(steps)
    return steps.steps


async def test_a_task_that_never_marks_yields_at_every_call():
    assert await _spied(fairness.yield_if_due) >= 1


async def test_a_task_scheduled_just_now_does_not_yield_again():
    async def call() -> None:
        fairness.scheduled_now()
        await fairness.yield_if_due()

    assert await _spied(call) == 0


async def test_a_marking_task_yields_once_it_has_run_past_the_budget(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(fairness.time, "perf_counter", lambda: now[0])

    async def call() -> None:
        fairness.scheduled_now()
        now[0] += fairness.YIELD_AFTER_S  # a burst: it has run the whole budget
        await fairness.yield_if_due()
        await fairness.yield_if_due()  # marked again by its yield: within budget

    assert await _spied(call) == 1


async def test_the_mark_belongs_to_the_task_that_set_it():
    marked = trio.Event()
    steps = []

    async def other() -> None:  # started before the mark: a pool worker, say
        await marked.wait()
        steps.append(await _spied(fairness.yield_if_due))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(other)
        await trio.lowlevel.checkpoint()
        fairness.scheduled_now()
        marked.set()
    assert steps[0] >= 1
