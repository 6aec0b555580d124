"""How a config file's TOML becomes typed values: strictly, within stated limits.

The config model is made of the library's own value classes (``Route``,
``FailurePolicy``, ``Layout``, ``Batching``, ``HttpConfig``, ...), structured
by one cattrs converter with three rules on top of cattrs' own:

- **no coercion**: an ``int`` field takes a TOML integer only (not ``1.5``,
  not ``true``), a ``float`` field an integer or a finite float (not ``nan``
  or ``inf``), a ``bool`` field ``true``/``false``, a ``str`` field a string,
  and a list a TOML array (a lone string is not a list of its characters);
- **limits**: every number a file may set has stated bounds (:data:`LIMITS`),
  so what would break a running service (a port past 65535, a billion
  workers, a negative capacity) is refused when the file is read, with the
  bounds in the message;
- **locations**: every problem is reported as ``key.path: problem``
  (``routes[0].workers: must be in [1, 1024], found 1000000000``).
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import attrs
import cattrs
from cattrs.errors import (
    AttributeValidationNote,
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
    IterableValidationNote,
)
from cattrs.gen import make_dict_structure_fn, override
from cattrs.v import format_exception

from taproute.routing.checks import Limit
from taproute.routing.errors import ConfigError, TaprouteError
from taproute.routing.failures import FAILURE_POLICY_LIMITS, FailurePolicy
from taproute.routing.layout import Column
from taproute.routing.routes import ROUTE_LIMITS, Route
from taproute.service.host.http import HttpConfig
from taproute.service.sinks.clickhouse import Batching, Retry
from taproute.service.sinks.clickhouse.batching import BATCHING_LIMITS, RETRY_LIMITS


class ConfigFileError(ConfigError):
    """A config file is unreadable or invalid: one line per problem, each
    naming the file and the key path (``router.toml: routes[0].workers: ...``)."""

    def __init__(self, path: Path, problems: list[str]) -> None:
        self.path = path
        self.problems = problems
        super().__init__("\n".join(f"{path}: {p}" for p in problems))


class ValueProblem(ValueError):
    """One value of a file is wrong; the message says expected vs found."""


#: Bounds of every number a config file may set, per value class and field.
#: Wide enough for any real deployment, narrow enough that a typo can't take
#: the process down (memory, a spinning core, an impossible socket).
LIMITS: dict[type, dict[str, Limit]] = {
    Route: dict(ROUTE_LIMITS),
    FailurePolicy: dict(FAILURE_POLICY_LIMITS),
    Column: {"shape": Limit(1, 2**31)},
    Batching: dict(BATCHING_LIMITS),
    Retry: dict(RETRY_LIMITS),
    HttpConfig: {"port": Limit(0, 65_535), "max_body_bytes": Limit(1, 2**30)},
}

#: Fields of library classes a file cannot set (not data: callables, provenance).
OMITTED: dict[type, tuple[str, ...]] = {Route: ("predicate",)}


def add_limits(cls: type, limits: Mapping[str, Limit]) -> None:
    """Register the bounds of a config-only class's fields (see :data:`LIMITS`)."""
    LIMITS.setdefault(cls, {}).update(limits)


def omit(cls: type, *fields: str) -> None:
    """Register fields of ``cls`` a file cannot set."""
    OMITTED[cls] = (*OMITTED.get(cls, ()), *fields)


# -- no coercion ---------------------------------------------------------------


def _found(value: object) -> str:
    kind = {bool: "boolean", int: "integer", float: "float", str: "string"}.get(type(value))
    if kind is None:
        kind = "array" if isinstance(value, list) else "table" if isinstance(value, dict) else ""
        kind = kind or type(value).__name__
    shown = repr(value)
    return f"{kind} {shown[:60]}" if kind in ("integer", "float", "string", "boolean") else kind


def _int(value: object, _: type) -> int:
    if type(value) is not int:
        raise ValueProblem(f"expected an integer, found {_found(value)}")
    return value


def _float(value: object, _: type) -> float:
    if type(value) not in (int, float):
        raise ValueProblem(f"expected a number, found {_found(value)}")
    assert isinstance(value, int | float)
    if not math.isfinite(value):
        raise ValueProblem(f"expected a finite number, found {value}")
    return float(value)


def _bool(value: object, _: type) -> bool:
    if type(value) is not bool:
        raise ValueProblem(f"expected true or false, found {_found(value)}")
    return value


def _str(value: object, _: type) -> str:
    if type(value) is not str:
        raise ValueProblem(f"expected a string, found {_found(value)}")
    return value


def _sequence(value: object, seq_type: Any) -> Any:
    if not isinstance(value, list | tuple):
        raise ValueProblem(f"expected an array, found {_found(value)}")
    item_type = seq_type.__args__[0]
    items, errors = [], []
    for index, item in enumerate(value):
        try:
            items.append(CONVERTER.structure(item, item_type))
        except Exception as exc:  # keep the index in the key path, as cattrs does
            note = IterableValidationNote(f"Structuring {seq_type} @ index {index}", index, item)
            exc.__notes__ = [*getattr(exc, "__notes__", []), note]
            errors.append(exc)
    if errors:
        raise IterableValidationError(f"While structuring {seq_type!r}", errors, seq_type)
    return tuple(items) if getattr(seq_type, "__origin__", None) is tuple else items


def _choices(options: tuple[object, ...]) -> str:
    return ", ".join(repr(option) for option in options)


def _literal(value: object, literal_type: Any) -> Any:
    options = get_args(literal_type)
    if value not in options or type(value) not in {type(option) for option in options}:
        raise ValueProblem(f"expected one of {_choices(options)}, found {_found(value)}")
    return value


def _is_literal(t: Any) -> bool:
    return get_origin(t) is Literal


def _enum(value: object, enum_type: Any) -> Any:
    options = tuple(member.value for member in enum_type)
    if type(value) is not type(options[0]) or value not in options:
        raise ValueProblem(f"expected one of {_choices(options)}, found {_found(value)}")
    return enum_type(value)


def _is_sequence(t: Any) -> bool:
    origin = getattr(t, "__origin__", None)
    return origin is list or (origin is tuple and t.__args__[-1:] == (Ellipsis,))


# -- limits and omitted fields -------------------------------------------------


def _limit_errors(cls: type, raw: Mapping[str, Any]) -> list[Exception]:
    errors: list[Exception] = []
    for field, limit in LIMITS.get(cls, {}).items():
        value = raw.get(field)
        values = value if isinstance(value, list) else [value]
        for item in values:
            if not isinstance(item, int | float) or isinstance(item, bool):
                continue  # the type rules report it
            if not math.isfinite(item):
                continue
            problem = limit.problem(item)
            if problem is not None:
                exc = ValueProblem(problem)
                note = AttributeValidationNote(f"Structuring {cls} @ {field}", field, float)
                exc.__notes__ = [note]
                errors.append(exc)
                break
    return errors


def _field_of(exc: BaseException) -> str | None:
    for note in getattr(exc, "__notes__", ()):
        if isinstance(note, AttributeValidationNote):
            return note.name
    return None


def _structure_attrs(cls: type) -> Callable[[Any, Any], Any]:
    overrides = {name: override(omit=True) for name in OMITTED.get(cls, ())}
    base: Callable[[Any, Any], Any] = make_dict_structure_fn(
        cls,
        CONVERTER,
        **overrides,  # type: ignore[arg-type]
    )

    def structure(raw: Any, _: Any) -> Any:
        if not isinstance(raw, Mapping):
            raise ValueProblem(f"expected a table, found {_found(raw)}")
        errors = _limit_errors(cls, raw)
        if errors:
            try:  # report the other fields' problems too, not only the bounds
                base(raw, cls)
            except ClassValidationError as exc:  # field problems; not the class's own check
                errors.extend(
                    e
                    for e in exc.exceptions
                    if _field_of(e) is not None or isinstance(e, ForbiddenExtraKeysError)
                )
            except Exception:  # the class's own check of what the bounds refused
                pass
            raise ClassValidationError(f"While structuring {cls.__name__}", errors, cls)
        return base(raw, cls)

    return structure


CONVERTER = cattrs.Converter(forbid_extra_keys=True)
CONVERTER.register_structure_hook(int, _int)
CONVERTER.register_structure_hook(float, _float)
CONVERTER.register_structure_hook(bool, _bool)
CONVERTER.register_structure_hook(str, _str)
CONVERTER.register_structure_hook_func(_is_sequence, _sequence)
CONVERTER.register_structure_hook_func(_is_literal, _literal)
# StrEnum before str: singledispatch follows the MRO, and a StrEnum is a str.
CONVERTER.register_structure_hook(enum.StrEnum, _enum)
CONVERTER.register_structure_hook(enum.Enum, _enum)
CONVERTER.register_structure_hook_factory(attrs.has, _structure_attrs)


# -- locations -----------------------------------------------------------------

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")
_DICT_KEY = re.compile(r"\['((?:[^'\\]|\\.)*)'\]")


def _key_path(path: str) -> str:
    """``$.destinations['ch'].raw`` -> ``destinations.ch.raw`` (TOML's way)."""
    path = path.removeprefix("$").removeprefix(".")

    def key(match: re.Match[str]) -> str:
        name = match.group(1)
        return f".{name}" if _BARE_KEY.match(name) else f'."{name}"'

    return _DICT_KEY.sub(key, path).removeprefix(".")


def _format(exc: BaseException, type_: type | None) -> str:
    if isinstance(exc, ValueProblem | TaprouteError):
        return str(exc)
    if isinstance(exc, ForbiddenExtraKeysError):
        unknown = ", ".join(repr(key) for key in sorted(exc.extra_fields))
        known = exc.cl.__name__ if exc.cl is not None else "this table"
        if exc.cl is not None and attrs.has(exc.cl):
            omitted = OMITTED.get(exc.cl, ())
            names = [f.name for f in attrs.fields(exc.cl) if f.name not in omitted]
            known = ", ".join(names)
        return f"unknown key(s) {unknown}; expected keys: {known}"
    return format_exception(exc, type_)


def problems_of(exc: ClassValidationError) -> list[str]:
    """Every problem of a failed structuring, as ``key.path: problem`` lines."""
    lines = []
    for message in cattrs.transform_error(exc, path="$", format_exception=_format):
        text, _, where = message.rpartition(" @ ")
        path = _key_path(where)
        lines.append(f"{path}: {text}" if path else text)
    return lines


def structure(raw: Mapping[str, Any], cls: type[Any]) -> Any:
    """``raw`` as a ``cls``; raises :class:`ClassValidationError` (see :func:`problems_of`)."""
    try:
        return CONVERTER.structure(raw, cls)
    except ConfigError as exc:  # raised by the top-level class itself
        raise ClassValidationError(f"While structuring {cls.__name__}", [exc], cls) from None
