"""The capture context: which request each batch row is, which positions are real.

The server sets it around a forward pass (:func:`capture_context`); every
capture hook that fires inside reads it.  It lives in a :mod:`contextvars`
variable, so it follows the code that set it, and is carried into a worker
thread only explicitly (:func:`carry_context`): a thread pool does not copy
contextvars on its own.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import operator
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, ParamSpec, Protocol, TypeVar

import attrs
import numpy as np
import numpy.typing as npt

from taproute.routing.errors import IngressFull, KeyNotHeld
from taproute.service.capture.errors import CaptureError, ContextMismatch

if TYPE_CHECKING:
    import torch

P = ParamSpec("P")
R = TypeVar("R")


def _int64_vector(values: Any) -> npt.NDArray[np.int64] | None:
    """``values`` as a C-contiguous int64 array (None stays None)."""
    return None if values is None else np.ascontiguousarray(values, dtype=np.int64)


@attrs.frozen(kw_only=True)
class CaptureContext:
    """What the server knows about the forward pass in flight.

    ``keys[i]`` is the request id of batch row ``i`` and ``step`` the decode
    step.  Which positions of a row are real tokens comes from ``lengths``
    (row ``i``'s first ``lengths[i]`` positions: right padding) or from
    ``attention_mask`` (the positions where it is non-zero, whatever the
    padding side); with neither, every position is real.

    ``starts``/``counts`` are each row's first real position and number of
    real positions when those positions are one run (``runs`` True), which
    lets a hook describe records as slices of one copied buffer; ``mask`` is
    the boolean mask (on the mask's device) for the general case.
    """

    keys: tuple[int, ...]
    step: int = 0
    lengths: tuple[int, ...] | None = None
    positions: int | None = None
    starts: npt.NDArray[np.int64] | None = attrs.field(
        default=None, eq=False, converter=_int64_vector
    )
    counts: npt.NDArray[np.int64] | None = attrs.field(
        default=None, eq=False, converter=_int64_vector
    )
    runs: bool = True
    mask: torch.Tensor | None = attrs.field(default=None, eq=False)
    #: Record plans (offsets, lengths, a descriptor template) by output shape,
    #: computed by the first hook that sees a shape and shared by the others.
    plans: dict[Any, Any] = attrs.field(factory=dict, init=False, eq=False, repr=False)

    #: ``keys`` as an int64 array, and what a record plan takes from this
    #: context (its real positions: None when every position is real) as a
    #: hashable value, contexts with equal ones sharing plans
    #: (:mod:`~taproute.service.capture.plans`).  Both computed here, when
    #: the server sets the context, not in its first hook call.
    key_array: npt.NDArray[np.int64] = attrs.field(init=False, eq=False, repr=False)
    positions_key: tuple[int | None, bool, bytes, bytes] | None = attrs.field(
        init=False, eq=False, repr=False
    )

    #: The most real positions of any row (0 without lengths or a mask).
    longest: int = attrs.field(init=False, eq=False, repr=False)

    @longest.default
    def _longest(self) -> int:
        counts = self.counts
        return int(counts.max()) if counts is not None and len(counts) else 0

    @key_array.default
    def _key_array(self) -> npt.NDArray[np.int64]:
        return np.asarray(self.keys, dtype=np.int64)

    @positions_key.default
    def _positions_key(self) -> tuple[int | None, bool, bytes, bytes] | None:
        if self.counts is None or self.starts is None:
            return None
        return (
            self.positions,
            self.runs,
            self.counts.tobytes(),
            self.starts.tobytes(),
        )

    @property
    def has_positions(self) -> bool:
        """True when lengths or a mask say which positions are real."""
        return self.counts is not None


_INT64 = (-(2**63), 2**63 - 1)


def _integers(
    name: str, values: Any, *, indexed: bool = True, caller: str = "capture_context"
) -> tuple[int, ...]:
    """``values`` as Python ints, each an integer (no float truncated, no string
    parsed) in int64's range; the error names the caller, the argument and the item."""
    try:
        items = list(values)
    except TypeError:
        raise ContextMismatch(
            f"{caller}: {name} must be a sequence of integers, found {type(values).__name__}"
        ) from None
    out = []
    for i, value in enumerate(items):
        where = f"{name}[{i}]" if indexed else name
        try:
            number = operator.index(value)
        except TypeError:
            raise ContextMismatch(
                f"{caller}: {where} = {value!r} is not an integer ({type(value).__name__})"
            ) from None
        if not _INT64[0] <= number <= _INT64[1]:
            raise ContextMismatch(f"{caller}: {where} = {number} is outside int64")
        out.append(number)
    return tuple(out)


def build_context(
    keys: Sequence[int],
    *,
    lengths: Sequence[int] | None = None,
    attention_mask: Any = None,
    step: int = 0,
    positions: int | None = None,
) -> CaptureContext:
    """Check and precompute a :class:`CaptureContext` (see :func:`capture_context`).

    ``positions``: the pass's positions per row when the caller knows them
    and neither ``lengths`` nor a mask says them (:func:`capture_decode`
    does), so a token-major output whose rows are not ``keys x positions``
    is refused rather than split at the wrong tokens."""
    key_tuple = _integers("keys", keys)
    (step,) = _integers("step", (step,), indexed=False)
    rows = len(key_tuple)
    if lengths is not None and attention_mask is not None:
        raise CaptureError("capture_context: give lengths or attention_mask, not both")
    if lengths is not None:
        counts = np.asarray(_integers("lengths", lengths), dtype=np.int64)
        if len(counts) != rows:
            raise ContextMismatch(
                f"capture_context: {len(counts)} lengths for {rows} keys (one length per row)"
            )
        negative = np.flatnonzero(counts < 0)
        if len(negative):
            row = int(negative[0])
            raise ContextMismatch(f"capture_context: lengths[{row}] = {counts[row]} is negative")
        return CaptureContext(
            keys=key_tuple,
            step=int(step),
            lengths=tuple(int(n) for n in counts),
            starts=np.zeros(rows, dtype=np.int64),
            counts=counts,
        )
    if attention_mask is not None:
        return _mask_context(key_tuple, attention_mask, int(step))
    return CaptureContext(keys=key_tuple, step=int(step), positions=positions)


def _mask_context(keys: tuple[int, ...], attention_mask: Any, step: int) -> CaptureContext:
    import torch

    mask = torch.as_tensor(attention_mask)
    if mask.dim() != 2 or mask.shape[0] != len(keys):
        raise ContextMismatch(
            f"capture_context: attention_mask must be (rows, positions) with {len(keys)} rows "
            f"(one per key), got shape {tuple(mask.shape)}"
        )
    mask = mask != 0
    host = mask.cpu().numpy()
    counts = host.sum(axis=1, dtype=np.int64)
    positions = host.shape[1]
    any_real = counts > 0
    starts = np.where(any_real, host.argmax(axis=1), 0).astype(np.int64)
    ends = np.where(any_real, positions - host[:, ::-1].argmax(axis=1), 0)
    runs = bool(np.all(ends - starts == counts))
    return CaptureContext(
        keys=keys,
        step=step,
        positions=positions,
        starts=starts,
        counts=counts,
        runs=runs,
        mask=None if runs else mask,
    )


_CONTEXT: contextvars.ContextVar[CaptureContext | None] = contextvars.ContextVar(
    "taproute_capture_context", default=None
)


class EndsKeys(Protocol):
    """What :func:`capture_context` ends its keys with (a runtime or service)."""

    def complete(self, *keys: int) -> object: ...

    def cancel(self, *keys: int) -> object: ...


def current_context() -> CaptureContext | None:
    """The capture context in effect here, or None."""
    return _CONTEXT.get()


@contextmanager
def capture_context(
    keys: Sequence[int],
    *,
    lengths: Sequence[int] | None = None,
    attention_mask: Any = None,
    step: int = 0,
    end_keys: EndsKeys | None = None,
) -> Iterator[CaptureContext]:
    """Set the request ids (and real positions, decode step) of the forward pass inside.

    ``keys``: one request id per batch row.  ``lengths``: real tokens per row,
    counted from position 0 (right padding).  ``attention_mask``: a
    ``(rows, positions)`` tensor or array, non-zero where a token is real (left
    or right padding, or holes).  Give one of the two, or neither when every
    position is real.  Checked here: one length per key, a mask row per key.

    ``end_keys`` (a runtime or service): the keys end with the block, when it
    is the request's last forward pass (or wraps the whole request): on
    normal exit they are completed (``end_keys.complete``: each stateful
    route's ``finalize`` emits the key's final rows after every record
    captured inside), on exit by an exception cancelled (``end_keys.cancel``).
    Neither waits for the router, and neither raises into the caller: a key
    the runtime refuses (:class:`KeyNotHeld`: no stateful route holds it) is
    counted by the runtime (``ingress.refused_key_controls``), a control it
    cannot take any more (closed, failed, its loop gone, not started) too
    (``ingress.failed_key_controls``), and so is one that found ingress full
    past the runtime's ``max_block`` (``ingress.shed_key_controls``: the
    keys stay open) or full under ``when_full="reject"``
    (``ingress.rejected_key_controls``); the first of each per runtime,
    action and kind is logged (logger ``taproute.capture``).  A block that
    exited by an exception re-raises that exception, whatever its cancel met.
    """
    context = build_context(keys, lengths=lengths, attention_mask=attention_mask, step=step)
    if end_keys is not None and not (
        callable(getattr(end_keys, "complete", None))
        and callable(getattr(end_keys, "cancel", None))
    ):  # checked before the pass, not found on the way out of it
        raise CaptureError(
            "capture_context: end_keys must be the runtime (or service) whose keys end "
            f"with the block (it has complete and cancel), found {type(end_keys).__name__}"
        )
    if end_keys is not None and getattr(end_keys, "ends_keys", True) is False:
        raise CaptureError(  # its complete() would raise after the forward pass
            "capture_context: end_keys is a runtime whose record sink keeps no keys (only a "
            "routing sink's stateful routes do): its keys cannot be completed"
        )
    token = _CONTEXT.set(context)
    try:
        yield context
    except BaseException:
        if end_keys is not None and context.keys:
            _end_keys(end_keys, "cancel", context.keys)  # never raises: theirs is seen
        raise
    finally:
        _CONTEXT.reset(token)
    if end_keys is not None and context.keys:
        _end_keys(end_keys, "complete", context.keys)


_log = logging.getLogger("taproute.capture")

#: Per runtime, the key actions whose refusal capture_context has logged.
_LOGGED: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()
_LOGGED_LOCK = threading.Lock()


def _end_keys(end_keys: EndsKeys, action: str, keys: tuple[int, ...]) -> None:
    """``end_keys.complete`` / ``.cancel`` of ``keys``; never raises.  A runtime
    answers with a future that nobody here waits for: a refusal it reports
    later (:class:`KeyNotHeld`, or a closed or failed runtime's error, both
    counted by the runtime) is logged, and so is an error the call raises at
    once (a runtime not started, another ``end_keys`` failing)."""
    try:
        # A runtime bounds the wait for ingress room by its max_block (and
        # counts a control shed past it); another end_keys is called plainly.
        bounded = getattr(end_keys, "end_capture_keys", None)
        outcome = bounded(action, keys) if callable(bounded) else getattr(end_keys, action)(*keys)
    except Exception as exc:  # the request's forward pass is done: not its error
        _report(end_keys, action, keys, exc)
        return
    if isinstance(outcome, Future):
        outcome.add_done_callback(functools.partial(_refused, end_keys, action, keys))


def _refused(end_keys: object, action: str, keys: tuple[int, ...], future: Future[Any]) -> None:
    """Log the first refusal of ``action`` per runtime and kind (the runtime
    counts every one).  Called on the runtime's loop thread when the control
    ran, or on the caller's when it was refused at once: never raises."""
    if future.cancelled():
        return
    error = future.exception()
    if error is not None:
        _report(end_keys, action, keys, error)


def _report(end_keys: object, action: str, keys: tuple[int, ...], error: BaseException) -> None:
    """Log ``error`` of ``action`` at the end of a block, once per runtime,
    action and kind (a key no route holds, or a control the runtime could not
    take); later ones are the runtime's counters'.  Never raises."""
    refused = isinstance(error, KeyNotHeld)
    full = isinstance(error, IngressFull)
    kind = f"{action}:{'refused' if refused else 'full' if full else 'failed'}"
    with _LOGGED_LOCK:
        try:
            logged = _LOGGED.setdefault(end_keys, set())
        except TypeError:  # not weakly referable: nowhere to remember it, log each
            logged = set()
        if kind in logged:
            return
        logged.add(kind)
    if refused:
        _log.warning(
            "capture_context: %s of keys %s at the end of the block was refused: %s "
            "(counted in ingress.refused_key_controls; later refusals of %s by this runtime "
            "are counted, not logged)",
            action,
            keys,
            error,
            action,
        )
    elif isinstance(error, IngressFull):
        _log.warning(
            "capture_context: %s of keys %s at the end of the block was not queued: %s "
            "(the keys stay open; counted in ingress.shed_key_controls past max_block, "
            "ingress.rejected_key_controls under when_full='reject'; later ones of %s by "
            "this runtime are counted, not logged)",
            action,
            keys,
            error,
            action,
        )
    else:
        _log.warning(
            "capture_context: %s of keys %s at the end of the block failed: %s: %s "
            "(not raised into the caller; counted in ingress.failed_key_controls by a "
            "runtime; later failures of %s by this runtime are not logged)",
            action,
            keys,
            type(error).__name__,
            error,
            action,
        )


def carry_context(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` bound to the capture context in effect now, to run in another thread.

    ``executor.submit(carry_context(model), input_ids)`` runs the forward
    pass in the pool's thread under the caller's capture context; without it
    the hooks there see no context and capture nothing (counted as skipped,
    reason ``no_context``).
    """
    if not callable(fn):
        raise CaptureError(
            f"carry_context: fn must be callable (the model, or a function running it), "
            f"found {type(fn).__name__}"
        )
    snapshot = contextvars.copy_context()

    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        # A copy per call: one Context cannot be entered by two threads at once.
        return snapshot.copy().run(fn, *args, **kwargs)

    return run
