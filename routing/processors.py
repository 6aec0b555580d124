"""Processors, registered by name at import time.

The Python form of ``DMI_REGISTER_*_PROCESSOR``::

    @stateless_processor("qk_norms", input="qk", output="qk_norm")
    def qk_norms(records: Records) -> np.ndarray: ...

    @stateful_processor("running_mean", key=lambda d: d["key"] % 4096, key_range=4096,
                        slot=SlotSpec((64,), "float64"), input="vec", output="mean")
    def running_mean(records: Records, keys: np.ndarray, state: StateRegion) -> np.ndarray: ...

A stateless processor maps a batch of records to rows of its output layout (a
numpy structured array; ``None`` for "nothing to emit").  A stateful one also
gets each record's key and the route's K x N :class:`StateRegion`; it may
read and write ``state.slots[k]`` for the keys it was given, in record order.
Processors run in worker threads: numpy releases the GIL, so they overlap.
"""

from __future__ import annotations

import enum
import inspect
import threading
from collections.abc import Callable, Iterable
from typing import Any, Generic, Protocol, TypeVar

import attrs
import numpy as np
import numpy.typing as npt

from taproute.routing.batch import Descriptors
from taproute.routing.errors import ConfigError, DuplicateProcessor, UnknownProcessor

KeyFunction = Callable[[Descriptors], npt.ArrayLike]
F = TypeVar("F", bound=Callable[..., Any])


def request_key(descriptors: Descriptors) -> npt.NDArray[np.int64]:
    """The default key function: the descriptor's ``key`` field as is."""
    return descriptors["key"]


class ProcessorKind(enum.StrEnum):
    """Which decorator registered a processor."""

    STATELESS = "stateless"
    STATEFUL = "stateful"


def _positive_shape(value: Any) -> tuple[int, ...]:
    dims = (value,) if isinstance(value, int) else value
    if isinstance(value, str | bytes) or not isinstance(dims, Iterable):
        raise ConfigError(f"SlotSpec shape: expected an int or a tuple of ints, found {value!r}")
    dims = tuple(dims)
    if not dims or any(isinstance(v, bool) or not isinstance(v, int | np.integer) for v in dims):
        raise ConfigError(
            f"SlotSpec shape: expected an int or a non-empty tuple of ints, found {value!r}"
        )
    shape = tuple(int(v) for v in dims)
    if any(v <= 0 for v in shape):
        raise ConfigError(f"SlotSpec shape must be positive, got {shape}")
    return shape


@attrs.frozen
class SlotSpec:
    """Shape and dtype of one key's state slot (the ``N`` of K x N)."""

    shape: tuple[int, ...] = attrs.field(converter=_positive_shape)
    dtype: str = "float64"

    def __attrs_post_init__(self) -> None:
        try:
            dtype = np.dtype(self.dtype)
        except TypeError as exc:
            raise ConfigError(f"SlotSpec dtype {self.dtype!r} is not a numpy dtype") from exc
        # A slot lives in one numeric K x N array (native StateRegion): Python
        # objects, text or records there are not state it can hold.
        if dtype.kind not in "biufc" or dtype.fields is not None:
            raise ConfigError(
                f"SlotSpec dtype {self.dtype!r}: expected a numeric dtype (bool, int, uint, float, "
                f"complex), found kind {dtype.kind!r}"
            )


@attrs.frozen(kw_only=True)
class ProcessorSpec:
    """A registered processor: its function and the layouts it reads and writes."""

    name: str
    fn: Callable[..., Any]
    kind: ProcessorKind
    input: str | None
    output: str
    key: KeyFunction | None = None
    key_range: int | None = None
    slot: SlotSpec | None = None
    #: Stateful only, for replay on several workers: ``merge(a, b) -> slots``
    #: combines two partial states of the same keys (arrays of shape
    #: ``(m, *slot.shape)``); ``finish(state, keys) -> rows`` turns the final
    #: state of ``keys`` into rows of the output layout.
    merge: Callable[[Any, Any], Any] | None = None
    finish: Callable[[Any, Any], Any] | None = None
    #: Stateful only: ``finalize(state, key) -> rows | None`` emits a key's
    #: final rows (``state`` is the route's :class:`StateRegion`; read
    #: ``state.slots[key]``) when the key is completed, before its slot is cleared.
    finalize: Callable[[Any, int], Any] | None = None
    #: Always call it in a worker thread, even when its calls are quick enough
    #: to run on the loop (it calls ``trio.from_thread``, or waits on other
    #: threads); see ``taproute.actors.attempt.Placement``.
    needs_thread: bool = False
    #: ``samples(context) -> [Sample, ...]``: named sample records built from
    #: the route's configuration, for ``taproute trace --samples`` (see
    #: :mod:`taproute.routing.samples`).
    samples: Callable[[Any], Iterable[Any]] | None = None

    def __attrs_post_init__(self) -> None:
        stateful = self.kind is ProcessorKind.STATEFUL
        calls: list[tuple[str, Callable[..., Any] | None, tuple[str, ...]]] = [
            (
                f"a {self.kind.value} processor",
                self.fn,
                ("records", "keys", "state") if stateful else ("records",),
            ),
            ("samples", self.samples, ("context",)),
        ]
        if stateful:
            calls += [
                ("key", self.key, ("descriptors",)),
                ("finalize", self.finalize, ("state", "key")),
                ("merge", self.merge, ("a", "b")),
                ("finish", self.finish, ("state", "keys")),
            ]
        for what, fn, arguments in calls:
            if fn is not None:
                _check_call(self.name, what, fn, arguments)


def _check_call(name: str, what: str, fn: Callable[..., Any], arguments: tuple[str, ...]) -> None:
    """Refuse ``fn`` if it cannot be called with ``arguments`` (positionally,
    as the router calls it); a signature that cannot be read is taken."""
    role = "fn" if what.startswith("a ") else what
    call = f"{role}({', '.join(arguments)})"
    if not callable(fn):
        raise ConfigError(
            f"processor {name!r}: {what} is called as {call}; found {type(fn).__name__} {fn!r:.60}"
        )
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin without a readable signature: taken on trust
    try:
        signature.bind(*arguments)
    except TypeError as exc:
        shown = getattr(fn, "__qualname__", type(fn).__name__)
        raise ConfigError(
            f"processor {name!r}: {what} is called as {call}; {shown}{signature} "
            f"cannot take it ({exc})"
        ) from None


class _Named(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def fn(self) -> Callable[..., Any]: ...


S = TypeVar("S", bound=_Named)


class NamedRegistry(Generic[S]):
    """Specs by name, thread-safe; re-registering the same function (a module
    reload) replaces it, a different function under a taken name is an error.

    ``kind`` names what is registered in messages (``"processor"``,
    ``"batch processor"``).
    """

    kind = "processor"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._specs: dict[str, S] = {}

    def register(self, spec: S) -> None:
        """Add ``spec``; a different function under a taken name is an error."""
        with self._lock:
            old = self._specs.get(spec.name)
            if old is not None and _qualname(old.fn) != _qualname(spec.fn):
                raise DuplicateProcessor(
                    f"{self.kind} name {spec.name!r} is already registered by "
                    f"{_qualname(old.fn)}; cannot register {_qualname(spec.fn)}"
                )
            self._specs[spec.name] = spec

    def get(self, name: str) -> S:
        """The spec called ``name``."""
        try:
            return self._specs[name]
        except KeyError:
            raise UnknownProcessor(
                f"unknown {self.kind} {name!r}; registered: {sorted(self._specs) or 'none'}"
            ) from None

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._specs)

    def __contains__(self, name: object) -> bool:
        return name in self._specs


class ProcessorRegistry(NamedRegistry[ProcessorSpec]):
    """Live processors by name (stateless and stateful)."""


def _qualname(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


#: The process-wide registry the decorators write to.
REGISTRY = ProcessorRegistry()


def stateless_processor(
    name: str,
    *,
    input: str | None,
    output: str,
    needs_thread: bool = False,
    samples: Callable[[Any], Iterable[Any]] | None = None,
    registry: ProcessorRegistry = REGISTRY,
) -> Callable[[F], F]:
    """Register ``fn(records) -> rows | None`` as stateless processor ``name``.

    ``input`` is the payload layout it reads (``None``: any; it reads
    descriptors only), ``output`` the layout of the rows it returns.
    ``needs_thread``: always call it in a worker thread (a quick processor
    otherwise runs on the loop, see the README's Performance section).
    ``samples(context) -> [Sample, ...]`` (optional) offers named sample
    records for ``taproute trace --samples`` (:mod:`taproute.routing.samples`).
    """

    def decorate(fn: F) -> F:
        registry.register(
            ProcessorSpec(
                name=name,
                fn=fn,
                kind=ProcessorKind.STATELESS,
                input=input,
                output=output,
                needs_thread=needs_thread,
                samples=samples,
            )
        )
        return fn

    return decorate


def stateful_processor(
    name: str,
    *,
    key_range: int,
    slot: SlotSpec,
    output: str,
    input: str | None,
    key: KeyFunction = request_key,
    merge: Callable[[Any, Any], Any] | None = None,
    finish: Callable[[Any, Any], Any] | None = None,
    finalize: Callable[[Any, int], Any] | None = None,
    needs_thread: bool = False,
    samples: Callable[[Any], Iterable[Any]] | None = None,
    registry: ProcessorRegistry = REGISTRY,
) -> Callable[[F], F]:
    """Register ``fn(records, keys, state) -> rows | None`` as stateful processor ``name``.

    ``key(descriptors)`` maps each record to a key in ``[0, key_range)``; the
    route keeps one ``slot``-shaped state per key.  ``merge`` and ``finish``
    (optional) let a replay combine partial states from several workers and
    write the final state as rows (see ``taproute.service.replay``).
    ``finalize(state, key) -> rows | None`` (optional) emits a key's final rows
    when the key is completed (see ``RoutingSink.complete``).
    ``needs_thread``: always call it in a worker thread (see
    :func:`stateless_processor`).  ``samples``: as for :func:`stateless_processor`.
    """
    if not isinstance(key_range, int) or key_range <= 0:
        raise ConfigError(
            f"processor {name!r}: key_range must be a positive int, got {key_range!r}"
        )

    def decorate(fn: F) -> F:
        registry.register(
            ProcessorSpec(
                name=name,
                fn=fn,
                kind=ProcessorKind.STATEFUL,
                input=input,
                output=output,
                key=key,
                key_range=key_range,
                slot=slot,
                merge=merge,
                finish=finish,
                finalize=finalize,
                needs_thread=needs_thread,
                samples=samples,
            )
        )
        return fn

    return decorate
