"""A ClickHouse sink's own arguments checked for their kind before anything is
opened: what a config file's reading refuses, refused the same way in Python.

A ``batching`` given as a dict raised ``AttributeError`` ('dict' object has no
attribute 'inserts_in_flight'), ``retry=3`` and ``create_tables="no"`` were
taken (the latter as True), ``raw=5`` raised "'int' object is not iterable",
and a table template that does not make a plain name (``raw_table="x`; DROP"``)
went into ``CREATE TABLE`` between backquotes (chDB's INCORRECT_QUERY).
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable

from taproute.routing.errors import ConfigError
from taproute.service.sinks.clickhouse.batching import Batching, Retry

_TABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def layouts(key: str, value: object) -> tuple[str, ...]:
    """``raw``/``rows``: a layout name, or an iterable of them."""
    if isinstance(value, str):
        return (value,)  # one layout's name alone is that layout, not its letters
    if isinstance(value, Iterable):
        names = tuple(value)
        if all(isinstance(name, str) and name for name in names):
            return names
    raise ConfigError(
        f"ClickHouseSink: {key} must be layout names (a str or a list of str), "
        f"found {type(value).__name__} {value!r:.60}"
    )


def table_name(key: str, template: object, layout: str) -> str:
    """``template`` (``raw_table``/``rows_table``) made for ``layout``: a plain
    name, the only field ``{layout}``."""
    if not isinstance(template, str):
        raise ConfigError(f"ClickHouseSink: {key} must be a str, found {type(template).__name__}")
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:
        raise ConfigError(
            f"ClickHouseSink: {key} {template!r}: not a valid template ({exc})"
        ) from None
    unknown = [f for f in fields if f != "layout"]
    if unknown:
        raise ConfigError(
            f"ClickHouseSink: {key} {template!r}: unknown field {{{unknown[0]}}} "
            "(the only field is {layout})"
        )
    table = template.format(layout=layout)
    if not _TABLE_NAME.match(table):
        raise ConfigError(
            f"ClickHouseSink: {key} {template!r} makes table name {table!r} (for layout "
            f"{layout!r}): it must be letters, digits and underscores, not starting with a digit"
        )
    return table


def check_kinds(
    *, batching: object, retry: object, create_tables: object, require_deduplication: object
) -> None:
    """The settings objects are theirs, the flags bools."""
    for key, value, kind, example in (
        ("batching", batching, Batching, "Batching(linger=1.0, ...)"),
        ("retry", retry, Retry, "Retry(attempts=5, ...)"),
    ):
        if value is not None and not isinstance(value, kind):
            raise ConfigError(
                f"ClickHouseSink: {key} must be a {kind.__name__} ({example}), "
                f"found {type(value).__name__} {value!r:.60}"
            )
    for key, flag in (
        ("create_tables", create_tables),
        ("require_deduplication", require_deduplication),
    ):
        if not isinstance(flag, bool):
            raise ConfigError(
                f"ClickHouseSink: {key} must be True or False, found {type(flag).__name__} {flag!r}"
            )
