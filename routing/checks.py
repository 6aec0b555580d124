"""Config validation from attrs' own validators, raising :class:`ConfigError`.

attrs' validators (``instance_of``, ``gt``, ``ge``, ``min_len``,
``deep_iterable``...) do the checking; :func:`config_check` composes them and
turns what they raise into one :class:`~taproute.routing.errors.ConfigError`
that names the owner, the field, what was expected and what was found.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs
from attrs import validators as v

from taproute.routing.errors import ConfigError

Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]


def config_check(*validators: Validator, must: str, owner: Callable[[Any], str]) -> Validator:
    """All of ``validators``; a failure raises ``ConfigError("<owner>: <field> must be
    <must>, got <value>")``."""
    combined = v.and_(*validators)

    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        try:
            combined(instance, attribute, value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"{owner(instance)}: {attribute.name} must be {must}, got {value!r}"
            ) from exc

    return check


#: A positive int.
POSITIVE_INT: tuple[Validator, ...] = (v.instance_of(int), v.gt(0))
#: A non-empty string.
NAME: tuple[Validator, ...] = (v.instance_of(str), v.min_len(1))
#: A number >= 0 (NaN fails the comparison).
NON_NEGATIVE: tuple[Validator, ...] = (v.instance_of((int, float)), v.ge(0))


def _finite(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not math.isfinite(value):
        raise ValueError(f"{attribute.name} must be finite, got {value!r}")


def _num(value: float) -> str:
    if isinstance(value, int) and abs(value) >= 2**20 and value & (value - 1) == 0:
        return f"2**{value.bit_length() - 1}"
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))  # 2592000, not 2.592e+06
    return f"{value:g}" if isinstance(value, float) else str(value)


@attrs.frozen
class Limit:
    """Inclusive bounds of a number: one home for a field's bounds, used by its
    class's own validator (:meth:`check`) and by config files (``LIMITS``).

    Wide enough for any real deployment, narrow enough that a typo cannot take
    the process down (memory, a spinning core, an impossible socket).
    """

    low: float
    high: float

    def problem(self, value: float) -> str | None:
        """Why ``value`` is outside the bounds, or None."""
        if self.low <= value <= self.high:
            return None
        return f"must be in [{_num(self.low)}, {_num(self.high)}], found {_num(value)}"

    def check(self, kind: type[int] | type[float], owner: Callable[[Any], str]) -> Validator:
        """An attrs validator: an int (``kind=int``) or a finite number
        (``kind=float``, NaN and infinities refused) within the bounds."""
        bounds = f"in [{_num(self.low)}, {_num(self.high)}]"
        if kind is int:
            must = f"a positive int <= {_num(self.high)}" if self.low == 1 else f"an int {bounds}"
            return config_check(
                v.instance_of(int), v.ge(self.low), v.le(self.high), must=must, owner=owner
            )
        return config_check(
            v.instance_of((int, float)),
            _finite,
            v.ge(self.low),
            v.le(self.high),
            must=f"a finite number {bounds}",
            owner=owner,
        )
