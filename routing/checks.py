"""Config validation from attrs' own validators, raising :class:`ConfigError`.

attrs' validators (``instance_of``, ``gt``, ``ge``, ``min_len``,
``deep_iterable``...) do the checking; :func:`config_check` composes them and
turns what they raise into one :class:`~taproute.routing.errors.ConfigError`
that names the owner, the field, what was expected and what was found.
"""

from __future__ import annotations

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
