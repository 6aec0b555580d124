"""A processor (or its key, finalize, merge or finish function) whose
signature cannot take the call the router makes is refused when it is
registered, naming the processor, the call and the function; it was taken,
and every record of its routes failed as a handler_panic TypeError and was
dead-lettered."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from taproute.routing import ConfigError, SlotSpec, stateful_processor, stateless_processor
from taproute.routing.processors import ProcessorRegistry

SLOT = SlotSpec((1,), "int64")


def stateful(name: str, registry: ProcessorRegistry, **options):
    return stateful_processor(
        name, input="vec", output="sum", key_range=4, slot=SLOT, registry=registry, **options
    )


def test_a_stateful_processor_that_takes_too_few_arguments_is_refused():
    registry = ProcessorRegistry()

    def count(records, state):
        return None

    with pytest.raises(
        ConfigError,
        match=r"processor 'p.count': a stateful processor is called as "
        r"fn\(records, keys, state\); .*count\(records, state\) cannot take it",
    ):
        stateful("p.count", registry)(count)
    assert "p.count" not in registry


@pytest.mark.parametrize(
    ("option", "function", "call"),
    [
        ("key", lambda: 0, r"key\(descriptors\)"),
        ("finalize", lambda state: None, r"finalize\(state, key\)"),
        ("merge", lambda a: a, r"merge\(a, b\)"),
        ("finish", lambda state, keys, extra: None, r"finish\(state, keys\)"),
    ],
)
def test_a_stateful_processors_helpers_are_checked_too(option, function, call):
    registry = ProcessorRegistry()
    with pytest.raises(ConfigError, match=rf"processor 'p.helper': {option} is called as {call}"):
        stateful("p.helper", registry, **{option: function})(lambda records, keys, state: None)


def test_a_stateless_processor_that_needs_more_arguments_is_refused():
    registry = ProcessorRegistry()

    def norms(records, scale):
        return None

    with pytest.raises(ConfigError, match=r"processor 'p.norms': .* fn\(records\); .*norms"):
        stateless_processor("p.norms", input="vec", output="norm", registry=registry)(norms)


def test_what_can_take_the_call_is_registered():
    """Defaults, *args, a partial, a callable object, and a builtin whose
    signature cannot be read are all taken."""
    registry = ProcessorRegistry()

    class Callable:
        def __call__(self, records, keys, state):
            return None

    def scaled(records, scale=2.0):
        return None

    def anything(*args):
        return None

    stateless_processor("p.scaled", input="vec", output="norm", registry=registry)(scaled)
    stateless_processor("p.any", input="vec", output="norm", registry=registry)(anything)
    stateless_processor("p.partial", input="vec", output="norm", registry=registry)(
        functools.partial(scaled, scale=3.0)
    )
    stateless_processor("p.builtin", input=None, output="norm", registry=registry)(np.asarray)
    stateful("p.object", registry)(Callable())
    assert registry.names() == ["p.any", "p.builtin", "p.object", "p.partial", "p.scaled"]
