"""Capture hooks inside a graph ``torch.compile`` traces: one opaque operator.

A capture hook's Python cannot be traced (it reads a context variable,
plans, copies and queues records), and running it eagerly is a graph
break, which ``torch.compile(..., fullgraph=True)`` refuses: a model bound
eagerly and compiled with ``fullgraph`` afterwards (or by transformers'
``compile_config``) raised Dynamo's ``Unsupported`` out of every forward
pass.  So under tracing a hook only picks its tensor out of the output and
calls ``torch.ops.taproute.capture([tensor], runner)``: a custom operator
with an ordered side effect (never dead-code eliminated nor reordered
against other captures), marked unsafe for CUDA graphs (a replay would
skip it), whose kernel runs the binding's eager capture with the real
tensor when the compiled graph runs, under the capture context in effect
then.  No graph break: fullgraph compiles and captures, and other compiled
models lose one graph break per bound module.  :func:`capture_decode`'s
hooks use it the same way (the pass's tokens and mask in, its context set
by the kernel).

The operator is defined once, when the first binding needs it; a torch too
old to define it leaves hooks running eagerly (a graph break, as before).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

from taproute.service.capture.errors import warn_capture

if TYPE_CHECKING:
    import torch

#: The operator's name: ``torch.ops.taproute.capture``.
OPERATOR = "taproute::capture"

#: What the operator's kernel calls with the tensors a traced hook passed it.
Runner = Callable[[list[Any]], None]

_RUNNERS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
#: The numbers torch.compile has traced a call of the operator with (its
#: fake kernel saw them): code compiled so far may pass them.
_TRACED: set[int] = set()
_NUMBERS = itertools.count(1)
_LOCK = threading.Lock()
_operator: Any = None
_defined = False


class Picked:
    """What a capture hook traced by torch.compile picked out of the module's
    output (``tensor``: None where its ``select`` gave no tensor), as the
    operator's kernel hands it to the eager capture: picked already, so not
    picked again (the eager capture refuses None as it refuses any output
    it cannot capture)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor

    def __repr__(self) -> str:
        return f"Picked({self.tensor!r})"


def as_tensor(value: Any) -> Any:
    """``value`` when it is a tensor, else None (what the operator takes)."""
    import torch

    return value if isinstance(value, torch.Tensor) else None


def capture_operator() -> Any:
    """``torch.ops.taproute.capture.default``, defined at the first call; None
    when this torch cannot define it (hooks then break the graph)."""
    global _operator, _defined
    if _defined:
        return _operator
    with _LOCK:
        if not _defined:
            try:
                _operator = _define()
            except Exception as exc:  # another torch's internals: say so, run eagerly
                warn_capture(
                    "capture hooks cannot be traced by torch.compile with this torch "
                    f"({type(exc).__name__}: {exc}); they run eagerly, a graph break at each "
                    "bound module, which torch.compile(fullgraph=True) refuses"
                )
                _operator = None
            _defined = True
    return _operator


def _define() -> Any:
    import torch
    from torch._library.effects import EffectType

    def capture(tensors: list[torch.Tensor | None], runner: int) -> None:
        run = _RUNNERS.get(runner)
        if run is not None:  # None: the hook that registered it is gone
            run(tensors)

    # The schema is read from the annotations, which this module's
    # ``from __future__ import annotations`` left as strings.
    capture.__annotations__ = {
        "tensors": list[Optional[torch.Tensor]],  # noqa: UP045 (what infer_schema reads)
        "runner": int,
        "return": None,
    }
    op = torch.library.custom_op(OPERATOR, mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))(
        capture
    )

    @op.register_fake
    def _(tensors: list[torch.Tensor | None], runner: int) -> None:
        # Run while torch.compile traces a call: that runner's number is in
        # compiled code from now on (see slots.py).
        _TRACED.add(runner)
        return None

    # Ordered: kept (it returns nothing, so it would be dead code) and run
    # in the order the hooks fired.
    torch.library._register_effectful_op(torch.ops.taproute.capture.default, EffectType.ORDERED)
    return torch.ops.taproute.capture.default


def register(runner: Runner, number: int | None = None) -> int:
    """The number a traced hook passes to the operator to run ``runner``
    (held weakly: keep it alive as long as a hook may pass its number).
    ``number``: run ``runner`` for a number handed out before (a hook slot
    taken again: see slots.py), in place of what ran for it."""
    if number is None:
        number = next(_NUMBERS)
    _RUNNERS[number] = runner
    return number


def new_number() -> int:
    """A number no runner has yet (for :func:`register` later)."""
    return next(_NUMBERS)


def traced(number: int) -> bool:
    """True once torch.compile traced a call of the operator with ``number``."""
    return number in _TRACED


def runners() -> int:
    """How many registered runners are still alive (for tests)."""
    return len(_RUNNERS)


__all__ = [
    "OPERATOR",
    "Picked",
    "as_tensor",
    "capture_operator",
    "new_number",
    "register",
    "traced",
]
