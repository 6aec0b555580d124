"""The runtime's options checked for their kind before anything is built.

A value of the wrong kind (``http=9464``, ``dead_letters="dl.sqlite"``,
``max_block="0.01"``) raised an ``AttributeError`` or a bare comparison
``TypeError`` deep inside, or (``capacity_records=1.5``, ``schema="acts"``)
was taken; each is refused here naming the option, what it takes and what
was found.  Bounds are checked where the options are used.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from taproute.routing.hooks import HookRegistry
from taproute.routing.schema import RecordSchema
from taproute.service.host.http import HttpConfig
from taproute.service.ops.dead_letters import DeadLetterStore


def _found(value: object) -> str:
    return f"{type(value).__name__} {value!r:.60}"


def _is_int(value: object) -> bool:  # numpy's integers too
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def check_runtime_options(**options: Any) -> None:
    """Raise ``TypeError`` for the first of ``options`` (a runtime's keyword
    arguments, by name) whose value is not of its kind."""
    for name in ("capacity_records", "capacity_bytes", "coalesce_records"):
        if name in options and not _is_int(options[name]):
            raise TypeError(f"{name}: expected an int, found {_found(options[name])}")
    for name, optional in (("max_block", True), ("wake_delay", False)):
        if name not in options:
            continue
        value = options[name]
        if not (_is_number(value) or (optional and value is None)):
            what = "seconds (a number) or None" if optional else "seconds (a number)"
            raise TypeError(f"{name}: expected {what}, found {_found(value)}")
    for name, kind in (("schema", RecordSchema), ("hooks", HookRegistry)):
        value = options.get(name)
        if value is not None and not isinstance(value, kind):
            raise TypeError(f"{name}: expected a {kind.__name__} or None, found {_found(value)}")
    if "name" in options and not isinstance(options["name"], str):
        raise TypeError(f"name: expected a str, found {_found(options['name'])}")


def check_service_options(http: object, dead_letters: object) -> None:
    """``http`` and ``dead_letters`` of a service: an ``HttpConfig`` and a
    ``DeadLetterStore`` (or None)."""
    if http is not None and not isinstance(http, HttpConfig):
        raise TypeError(
            f"http: expected an HttpConfig (http=HttpConfig(port=9464)), found {_found(http)}"
        )
    if dead_letters is not None and not isinstance(dead_letters, DeadLetterStore):
        raise TypeError(
            "dead_letters: expected a DeadLetterStore (dead_letters=DeadLetterStore(path)), "
            f"found {_found(dead_letters)}"
        )
