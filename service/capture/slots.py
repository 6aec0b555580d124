"""A bound module's place among its forward hooks, kept once torch.compile traced it.

Dynamo guards the code it compiled on the number of each traced module's
forward hooks and on what each hook read while traced: its code, the
capture operator, its number, its ``select`` (not the hook object itself).
Removing a binding's hook failed the first guard; binding the module again
added a hook the code compiled without it never calls, so every compiled
entry was invalidated (see compiled.py).  A compile each time, and Dynamo
counts every compile of a code object, invalidated ones included, against
``recompile_limit``: a few bind/remove rounds on a compiled model, and one
compiled with ``fullgraph=True`` raised ``FailOnRecompileLimitHit`` out of
every forward pass from then on.

So a hook that compiled code traced keeps its place when its binding is
removed: the place gets an inert hook of the same code, operator, number
and select, which does nothing eagerly, and whose operator calls find no
binding to run.  A later binding of the module takes the place again, with
the same number, so compiled code, guards unchanged, runs its capture: no
recompile, however often a module is bound and removed (one per ``select``
a place is bound with, each kept by Dynamo).  A hook no compiled code has
traced (an eager model's) is unhooked for real, as before.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from taproute.service.capture.traced import new_number, traced

if TYPE_CHECKING:
    import torch


class HookSlot:
    """A place among a module's forward hooks (``id``: torch's hook id, None
    until placed) and the operator number its hooks pass."""

    __slots__ = ("id", "number", "select", "taken")

    def __init__(self, number: int, select: Any) -> None:
        self.id: int | None = None
        self.number = number
        #: The ``select`` its hook was last bound with (what Dynamo guards on).
        self.select = select
        self.taken = True


#: Per module, its places (they hold no reference to the module).
_SLOTS: weakref.WeakKeyDictionary[Any, list[HookSlot]] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def _same_select(a: Any, b: Any) -> bool:
    return a is b or (not callable(a) and type(a) is type(b) and a == b)


def take(module: torch.nn.Module, select: Any) -> HookSlot:
    """A free place of ``module`` for a hook with ``select`` (one last bound
    with the same ``select`` first: its compiled code's guards then hold), or
    a new one (:func:`place` registers its hook)."""
    with _LOCK:
        hooks = module._forward_hooks
        # Places whose hook someone else removed (hooks cleared) are gone.
        slots = [slot for slot in _SLOTS.get(module, ()) if slot.id in hooks]
        if slots:
            _SLOTS[module] = slots
        else:
            _SLOTS.pop(module, None)
        free = [slot for slot in slots if not slot.taken]
        same = [slot for slot in free if _same_select(slot.select, select)]
        if not free:
            return HookSlot(new_number(), select)
        chosen = (same or free)[0]
        chosen.taken = True
        chosen.select = select
        return chosen


def place(module: torch.nn.Module, slot: HookSlot, hook: Callable[..., Any]) -> None:
    """Put ``hook`` in ``slot``: registered when new, else in the inert hook's place."""
    with _LOCK:
        if slot.id is None:
            slot.id = module.register_forward_hook(hook).id
            _SLOTS.setdefault(module, []).append(slot)
        else:
            module._forward_hooks[slot.id] = hook


class SlotHandle:
    """What a binding's ``remove()`` calls: vacates its hook's place."""

    def __init__(self, module: torch.nn.Module, slot: HookSlot, inert: Callable[..., Any]) -> None:
        self._module = weakref.ref(module)
        self._slot = slot
        self._inert = inert

    def remove(self) -> None:
        """The inert hook in the place when compiled code traced it, else unhooked."""
        module = self._module()
        if module is None:
            return
        slot = self._slot
        with _LOCK:
            hooks = module._forward_hooks
            if slot.id not in hooks:
                return
            if traced(slot.number):
                hooks[slot.id] = self._inert
                slot.taken = False
                return
            del hooks[slot.id]
            kept = [other for other in _SLOTS.get(module, ()) if other is not slot]
            if kept:
                _SLOTS[module] = kept
            else:
                _SLOTS.pop(module, None)


__all__ = ["HookSlot", "SlotHandle", "place", "take"]
