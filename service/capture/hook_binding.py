"""What a bound capture hook is: the runtime it captures into
(:class:`CaptureTarget`), its handle (:class:`HookBinding`: detached after an
error, warned once per reason, removable), and the reasons records are
skipped or dropped (the ``reason`` label of the capture counters).

:mod:`~taproute.service.capture.binding` registers the hooks themselves.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Protocol

from taproute.routing.batch import RecordBatch
from taproute.routing.hooks import HookRegistry
from taproute.routing.schema import RecordSchema
from taproute.service.capture.errors import CaptureError, warn_capture


class CaptureTarget(Protocol):
    """What capture hooks need of the runtime (a ``RecordService`` or ``RecordRuntime``)."""

    @property
    def schema(self) -> RecordSchema | None: ...

    @property
    def hooks(self) -> HookRegistry: ...

    def bind_hook(self, name: str, *, layout: str | None = None) -> int: ...

    def offer_captured(self, batch: RecordBatch) -> bool: ...

    def count_dropped(self, hook: str, reason: str, records: int) -> None: ...

    def count_skipped(self, hook: str, reason: str) -> None: ...


# Why records were not captured (the ``reason`` label of the counters).
NO_CONTEXT = "no_context"  # skipped: the hook ran outside any capture context
INVALID_CONTEXT = "invalid_context"  # dropped: lengths/mask/keys do not fit the output
BAD_OUTPUT = "bad_output"  # dropped, binding detached: output can't be captured as bound
RUNTIME_FAILED = "runtime_failed"  # dropped, binding detached: submit raised
RUNTIME_CLOSED = "runtime_closed"  # dropped: the runtime was closed (cleanly)
DETACHED = "detached"  # dropped: calls after the binding detached
MAX_BLOCK = "max_block"  # dropped: ingress stayed full longer than max_block
INGRESS_FULL = "ingress_full"  # dropped: ingress full and the runtime rejects (when_full)


class HookBinding:
    """A registered capture hook.

    ``detached`` is set (with ``error``) once the binding stopped capturing
    because its output cannot be captured as bound or the runtime failed;
    :meth:`remove` stops it for good (unhooked, or where torch.compile
    traced the hook, an inert hook kept in its place: see slots.py).
    """

    def __init__(self, name: str, output_id: int, handle: Any = None) -> None:
        self.name = name
        self.output_id = output_id
        self.error: BaseException | None = None
        #: What :meth:`remove` removes (a torch hook handle, or anything with ``remove()``).
        self._handle: Any = handle
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    @property
    def detached(self) -> bool:
        """True once the binding stopped capturing after an error."""
        return self.error is not None

    def remove(self) -> None:
        """Stop capturing (idempotent)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    @property
    def removed(self) -> bool:
        """True once :meth:`remove` ran (the binding captures nothing more)."""
        return self._handle is None

    def _warn_once(self, reason: str, message: str) -> None:
        with self._lock:
            if reason in self._warned:
                return
            self._warned.add(reason)
        warn_capture(message)


#: Per module, the bindings made on it: (the runtime's hook registry, binding).
_BOUND: weakref.WeakKeyDictionary[Any, list[tuple[weakref.ref[HookRegistry], HookBinding]]] = (
    weakref.WeakKeyDictionary()
)
_BOUND_LOCK = threading.Lock()


def check_unbound(module: Any, hooks: HookRegistry, name: str) -> None:
    """Refuse binding ``module`` under ``name`` to the runtime of ``hooks`` a
    second time while the first binding is in place: both torch hooks would
    fire, and every record would be captured (and written) twice."""
    with _BOUND_LOCK:
        for registry, binding in _BOUND.get(module, ()):
            if registry() is hooks and binding.name == name and not binding.removed:
                raise CaptureError(
                    f"hook {name!r} is already bound on this module to this runtime (an "
                    "earlier bind_module/bind_modules); a second binding would capture "
                    "every record twice: remove() the first binding, or bind under "
                    "another name"
                )


def note_bound(module: Any, hooks: HookRegistry, binding: HookBinding) -> None:
    """Remember ``binding`` of ``module`` (forgetting the removed ones)."""
    with _BOUND_LOCK:
        kept = [
            (registry, earlier)
            for registry, earlier in _BOUND.get(module, ())
            if registry() is not None and not earlier.removed
        ]
        kept.append((weakref.ref(hooks), binding))
        _BOUND[module] = kept


__all__ = [
    "check_unbound",
    "note_bound",
    "BAD_OUTPUT",
    "DETACHED",
    "INGRESS_FULL",
    "INVALID_CONTEXT",
    "MAX_BLOCK",
    "NO_CONTEXT",
    "RUNTIME_CLOSED",
    "RUNTIME_FAILED",
    "CaptureTarget",
    "HookBinding",
]
