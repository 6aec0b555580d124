"""Sink calls a shutdown can cut, without a cancel scope for every quick call.

A destination's sink calls must be cancellable by a shutdown's cut (see
:mod:`taproute.actors.destination`), which needs a :class:`trio.CancelScope`
around each.  Entering and leaving one costs about 3.9 µs here, more than a
quick sink's whole ``submit`` (an append to a buffer), and the record worker
pays it on its own task for every batch it delivers inline.  But a call that
returns without suspending can never be cut: a cut runs in another task, so
only while the call waits.  :class:`CuttableCalls` therefore runs a frequent
call's first step bare (``scope_when_waiting=True``: a destination's
submits) and enters the scope only when the call suspends, before its first
wait reaches Trio: everything the call waits for is inside the scope, as if
the scope had been entered first.  Rare calls (flush, close) get the scope
first, as a ``with`` block gives it.

One case cannot be wrapped late: a call whose first step entered a cancel
scope or a nursery of its own (a ``move_on_after`` around its wait) and
waits inside it.  A scope entered then would nest inside the call's, so the
call goes on without it (it cannot be cut, though its own timeout still
holds) and that kind of call gets its scope first from then on.  Where Trio
does not show a task's cancel status (it is not public API), every call gets
its scope first.
"""

from __future__ import annotations

import types
from collections.abc import Awaitable, Coroutine, Generator
from typing import Any

import trio


class CuttableCalls:
    """The calls of one sink under way, each cancellable by :meth:`cut`.

    Calls are named by kind (``"submit"``, ``"flush"``, ``"close"``); what
    :attr:`under_way` names is what a cut would cancel.
    """

    def __init__(self) -> None:
        #: The calls waiting now, each with the scope a cut cancels.
        self._waiting: dict[trio.CancelScope, str] = {}
        #: Set by :meth:`cut`: calls from now on are cancelled when they wait.
        self.is_cut = False
        #: A call in its first step (it may block the loop thread there).
        self._starting: str | None = None
        #: Kinds of call whose first step opened a scope of their own: these
        #: get their scope before they start.
        self._scope_first: set[str] = set()

    @property
    def under_way(self) -> str | None:
        """The kind of a call under way now, None when none is."""
        if self._starting is not None:
            return self._starting
        for what in self._waiting.values():
            return what
        return None

    def cut(self) -> None:
        """Cancel every call waiting now, and every later call once it waits."""
        self.is_cut = True
        for scope in self._waiting:
            scope.cancel()

    async def run(self, what: str, call: Awaitable[Any], *, scope_when_waiting: bool) -> bool:
        """Await ``call``, a call of kind ``what``, where :meth:`cut` can cancel
        it: True once it returned, False when a cut cancelled it (the
        :class:`trio.Cancelled` is absorbed).  An exception the call raises
        propagates.

        ``scope_when_waiting``: run its first step bare and enter the scope
        only if it waits (for frequent calls that usually return at once);
        else the scope is entered first, as a ``with`` block would.
        """
        task = trio.lowlevel.current_task()
        status = getattr(task, "_cancel_status", None)
        if (
            not scope_when_waiting
            or what in self._scope_first
            or status is None
            or (type(call) is not types.CoroutineType and not isinstance(call, Coroutine))
        ):
            scope = self._enter(what)
            try:
                with scope:
                    await call
                    return True
                return False
            finally:
                del self._waiting[scope]
        before, self._starting = self._starting, what
        try:
            trap = call.send(None)
        except StopIteration:
            return True  # returned without waiting: nothing could have cut it
        finally:
            self._starting = before
        if getattr(task, "_cancel_status", None) is not status:
            # It waits inside a scope or nursery it entered: ours would nest
            # inside it (Trio calls that a corrupt scope stack).
            self._scope_first.add(what)
            unscoped = trio.CancelScope()  # never entered: a cut cannot reach it
            self._waiting[unscoped] = what
            try:
                await _resume(call, trap)
                return True
            finally:
                del self._waiting[unscoped]
        scope = self._enter(what)
        try:
            with scope:
                await _resume(call, trap)
                return True
            return False
        finally:
            del self._waiting[scope]

    def _enter(self, what: str) -> trio.CancelScope:
        scope = trio.CancelScope()
        if self.is_cut:
            scope.cancel()
        self._waiting[scope] = what
        return scope


@types.coroutine
def _resume(call: Coroutine[Any, Any, Any], trap: Any) -> Generator[Any, Any, Any]:
    """Go on with ``call`` from the ``trap`` its first step yielded: what
    ``yield from call`` does for a coroutine not yet started."""
    while True:
        try:
            sent = yield trap
        except GeneratorExit:
            call.close()
            raise
        except BaseException as exc:
            try:
                trap = call.throw(exc)
            except StopIteration as stop:
                return stop.value
            continue
        try:
            trap = call.send(sent)
        except StopIteration as stop:
            return stop.value
