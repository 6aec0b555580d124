"""CuttableCalls: a sink call a cut can cancel, with its cancel scope entered
only once the call waits."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from taproute.actors.cuttable import CuttableCalls


async def quick() -> str:
    return "done"


async def test_a_call_that_never_waits_returns_and_leaves_nothing_under_way():
    calls = CuttableCalls()
    assert await calls.run("submit", quick(), scope_when_waiting=True) is True
    assert calls.under_way is None


async def test_a_waiting_call_is_named_while_under_way_and_a_cut_cancels_it():
    calls = CuttableCalls()
    finished: list[bool] = []
    reached = trio.Event()

    async def hangs() -> None:
        reached.set()
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:

        async def call() -> None:
            finished.append(await calls.run("flush", hangs(), scope_when_waiting=True))

        nursery.start_soon(call)
        await reached.wait()
        await trio.testing.wait_all_tasks_blocked()
        assert calls.under_way == "flush"
        calls.cut()
    assert finished == [False]
    assert calls.under_way is None


async def test_after_a_cut_a_call_that_waits_is_cancelled_and_a_quick_one_still_runs():
    calls = CuttableCalls()
    calls.cut()
    assert await calls.run("submit", quick(), scope_when_waiting=True) is True
    assert await calls.run("submit", trio.sleep_forever(), scope_when_waiting=True) is False


async def test_what_a_call_raises_propagates_before_and_after_it_waits():
    calls = CuttableCalls()

    async def raises_at_once() -> None:
        raise ValueError("bare")

    async def raises_after_waiting() -> None:
        await trio.lowlevel.checkpoint()
        raise ValueError("waited")

    with pytest.raises(ValueError, match="bare"):
        await calls.run("submit", raises_at_once(), scope_when_waiting=True)
    with pytest.raises(ValueError, match="waited"):
        await calls.run("submit", raises_after_waiting(), scope_when_waiting=True)
    assert calls.under_way is None


async def test_a_cancellation_from_outside_is_not_absorbed():
    calls = CuttableCalls()
    with trio.move_on_after(0.01) as outer:
        await calls.run("submit", trio.sleep_forever(), scope_when_waiting=True)
        pytest.fail("the outer cancellation was absorbed")
    assert outer.cancelled_caught


@pytest.mark.parametrize("opens", ["scope", "nursery"])
async def test_a_call_waiting_in_a_scope_of_its_own_runs_and_its_kind_is_scoped_first_after(
    opens: str, autojump_clock: trio.testing.MockClock
):
    """Its own scope was entered before ours could be: the call goes on
    uncut (its own timeout holds, the scope stack stays sound), and later
    calls of its kind get their scope first, so a cut reaches them."""
    calls = CuttableCalls()

    async def bounded() -> str:
        if opens == "scope":
            with trio.move_on_after(5):
                await trio.sleep_forever()
        else:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.sleep, 5)
        return "timed out"

    assert await calls.run("close", bounded(), scope_when_waiting=True) is True
    assert calls.under_way is None
    finished: list[bool] = []
    async with trio.open_nursery() as nursery:

        async def call() -> None:
            finished.append(await calls.run("close", bounded(), scope_when_waiting=True))

        nursery.start_soon(call)
        await trio.sleep(1)
        assert calls.under_way == "close"
        calls.cut()
    assert finished == [False]
    assert trio.current_time() < 7  # cut at 6 s, not let run to its own 5 s timeout


async def test_an_awaitable_that_is_not_a_coroutine_is_awaited_under_its_scope():
    calls = CuttableCalls()

    class Later:
        def __await__(self):  # type: ignore[no-untyped-def]
            return (yield from trio.lowlevel.checkpoint().__await__())

    assert await calls.run("submit", Later(), scope_when_waiting=True) is True


@pytest.mark.parametrize("scope_when_waiting", [False, True])
async def test_a_call_scoped_first_is_cut_even_inside_a_scope_of_its_own(scope_when_waiting: bool):
    """Scoped first, the first call of a kind that opens its own scope can be
    cut too (a flush or close: rare calls, never worth the bare first step)."""
    calls = CuttableCalls()
    finished: list[bool] = []
    entered = trio.Event()

    async def bounded() -> None:
        with trio.move_on_after(3600):
            entered.set()
            await trio.sleep_forever()

    async with trio.open_nursery() as nursery:

        async def call() -> None:
            finished.append(
                await calls.run("close", bounded(), scope_when_waiting=scope_when_waiting)
            )

        nursery.start_soon(call)
        await entered.wait()
        await trio.testing.wait_all_tasks_blocked()
        calls.cut()
        if scope_when_waiting:  # its first call ran unscoped: only its own timeout ends it
            nursery.cancel_scope.cancel()
    assert finished == ([] if scope_when_waiting else [False])
