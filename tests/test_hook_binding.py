"""A hook binding is all-or-nothing: its id is given out only once every
listener (a route table following the registry) has taken it.

``HookRegistry.bind`` published the name before calling its listeners: a
listener that raised left the hook bound (the next ``bind`` returned its id
as if nothing had happened, and the listener never learnt of it), and
another thread asking for the name meanwhile got an id no route table knew
yet (its records went unmatched)."""

from __future__ import annotations

import threading

import pytest

from taproute.routing import HookBindingError, HookRegistry


def test_a_listener_that_raises_leaves_the_hook_unbound_and_the_error_names_it():
    hooks = HookRegistry()
    told: list[tuple[str, int]] = []
    hooks.subscribe(lambda name, output_id: told.append((name, output_id)))
    broken = True

    def refuse(name: str, output_id: int) -> None:
        if broken and name == "layers.1":
            raise RuntimeError("route table full")

    hooks.subscribe(refuse)
    first = hooks.bind("layers.0")
    with pytest.raises(HookBindingError) as refused:
        hooks.bind("layers.1")
    assert str(refused.value) == (
        "hook 'layers.1' is not bound: a listener of its binding raised "
        "RuntimeError: route table full"
    )
    assert isinstance(refused.value.__cause__, RuntimeError)
    assert hooks.id_of("layers.1") is None
    assert hooks.names() == ("layers.0",) and len(hooks) == 1
    # Bound again once the listener takes it: every listener is told, and the
    # id is the next one after the hooks that are bound.
    broken = False
    again = hooks.bind("layers.1")
    assert again == first + 1
    assert hooks.names() == ("layers.0", "layers.1")
    assert told[-1] == ("layers.1", again)
    assert hooks.bind("layers.1") == again


def test_the_id_is_not_given_out_before_the_listeners_took_it():
    hooks = HookRegistry()
    entered, release = threading.Event(), threading.Event()

    def slow(name: str, output_id: int) -> None:
        entered.set()
        assert release.wait(60), "the test never released the listener"

    hooks.subscribe(slow)
    result: list[int] = []
    binder = threading.Thread(target=lambda: result.append(hooks.bind("layers.0")))
    binder.start()
    try:
        assert entered.wait(60)
        # The listener runs: the name is not bound yet for anyone else.
        assert hooks.id_of("layers.0") is None
        assert hooks.names() == ()
    finally:
        release.set()
        binder.join(60)
    assert result == [0] and hooks.id_of("layers.0") == 0
