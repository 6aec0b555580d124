"""Hook names and the output_ids records carry.

``bind_hook("layers.3.attn.q")`` gives a small integer id the producer stamps
on each record; routes are configured by name (or glob) and resolved to ids
through this registry, including for names bound after a route table was built.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from taproute.routing.errors import HookBindingError

#: Called with ``(name, output_id)`` for every new binding.
BindListener = Callable[[str, int], None]


class HookRegistry:
    """Thread-safe, append-only map between hook names and output_ids.

    Binding the same name again returns the same id.  A hook may declare the
    layout its records carry by default; re-binding with a different layout is
    an error.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Held while a new name's listeners run (and while a subscriber is told
        # of the names bound so far): a binding is published only once every
        # listener took it, and one bind at a time is told to them.  Reentrant:
        # a listener may bind another name.
        self._binding = threading.RLock()
        self._ids: dict[str, int] = {}
        self._names: list[str] = []
        self._layouts: list[str | None] = []
        self._token_shapes: dict[int, tuple[int, ...] | None] = {}
        self._listeners: list[BindListener] = []
        self._names_view: tuple[str, ...] = ()

    def bind(self, name: str, *, layout: str | None = None) -> int:
        """Return the output_id for ``name``, allocating one on first use.

        All or nothing: a new name is bound (``id_of`` and ``names`` show it,
        another ``bind`` of it returns its id) only once every listener has
        taken it.  A listener that raises leaves it unbound and raises
        :class:`HookBindingError` naming the hook (the listener's exception
        is its ``__cause__``); the listeners told before it were told an
        output_id that the next new name gets, and they are told again then.
        """
        if not isinstance(name, str) or not name:
            raise HookBindingError(f"hook name must be a non-empty string, got {name!r}")
        with self._lock:  # bound already: no wait for another name's listeners
            existing = self._bound(name, layout)
        if existing is not None:
            return existing
        with self._binding:
            with self._lock:
                existing = self._bound(name, layout)
                if existing is not None:  # bound by another thread meanwhile
                    return existing
                output_id = len(self._names)
                listeners = list(self._listeners)
            try:
                for listener in listeners:
                    listener(name, output_id)
            except Exception as exc:
                raise HookBindingError(
                    f"hook {name!r} is not bound: a listener of its binding raised "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            with self._lock:
                self._ids[name] = output_id
                self._names.append(name)
                self._layouts.append(layout)
                self._names_view = tuple(self._names)
        return output_id

    def _bound(self, name: str, layout: str | None) -> int | None:
        """``name``'s output_id if it is bound (its layout checked and noted),
        else None.  Under ``_lock``."""
        existing = self._ids.get(name)
        if existing is None:
            return None
        bound_layout = self._layouts[existing]
        if layout is not None and bound_layout not in (None, layout):
            raise HookBindingError(
                f"hook {name!r} is bound with layout {bound_layout!r}, not {layout!r}"
            )
        if layout is not None:
            self._layouts[existing] = layout
        return existing

    def subscribe(self, listener: BindListener) -> Callable[[], None]:
        """Call ``listener`` for each existing and every future binding.

        Returns a function that unsubscribes.
        """
        with self._binding:  # no binding is half told: it is in ``existing`` or told later
            with self._lock:
                self._listeners.append(listener)
                existing = list(enumerate(self._names))
            for output_id, name in existing:
                listener(name, output_id)

        def unsubscribe() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return unsubscribe

    def id_of(self, name: str) -> int | None:
        """The output_id bound to ``name``, or None."""
        return self._ids.get(name)

    def name_of(self, output_id: int) -> str:
        """The hook name of ``output_id``."""
        try:
            return self._names[output_id]
        except IndexError:
            raise KeyError(f"output_id {output_id} was never bound") from None

    def layout_of(self, output_id: int) -> str | None:
        """The layout name declared for ``output_id``'s hook, if any."""
        return self._layouts[output_id]

    def set_token_shape(self, output_id: int, shape: tuple[int, ...] | None) -> None:
        """Say the shape of one position's values in ``output_id``'s records.

        A record of ``n`` values then has the shape ``[n / prod(shape), *shape]``
        (a capture hook's ``[tokens, hidden]``); None: a flat ``[n]``.
        """
        self._token_shapes[output_id] = None if shape is None else tuple(shape)

    def token_shape_of(self, output_id: int) -> tuple[int, ...] | None:
        """The shape of one position's values in ``output_id``'s records, if said."""
        return self._token_shapes.get(output_id)

    def names(self) -> tuple[str, ...]:
        """Every bound name, in output_id order.

        An immutable view, rebuilt only when a hook is bound (rare), so readers
        on hot paths (a sink naming every insert's hooks) copy nothing.
        """
        return self._names_view

    def __len__(self) -> int:
        return len(self._names)
