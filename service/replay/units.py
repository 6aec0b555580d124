"""Work units and corpus filters: what a replay walks, deterministically.

A feed plan is the ordered list of :class:`WorkUnit` a corpus yields for one
set of filters.  Each unit has a stable id derived from what it selects (the
source, the hook, the key range or the file and row group), so the same corpus
and filters give the same plan, and a resumed run recognises finished units.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
from collections.abc import Iterable
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from taproute.service.replay.errors import ReplayConfigError


def _range(name: str, value: Any) -> tuple[int, int] | None:
    """The range field ``name``: a ``[low, high)`` pair of integers (``low <
    high``), or None; anything else is refused naming the field."""
    if value is None:
        return None
    pair = _integers(value)
    if pair is None:
        raise ReplayConfigError(
            f"Filters {name}: expected a [low, high) pair of integers, found {value!r}"
        )
    lo, hi = pair
    if lo >= hi:
        raise ReplayConfigError(
            f"Filters {name}: expected a [low, high) range with low < high, found [{lo}, {hi})"
        )
    return (lo, hi)


def _hooks(value: Any) -> tuple[str, ...]:
    """The hook globs: one string is one glob (never its characters)."""
    if isinstance(value, str):
        return (value,)
    items = list(value) if isinstance(value, Iterable) else None
    if items is None or not all(isinstance(item, str) for item in items):
        raise ReplayConfigError(
            f"Filters hooks: expected a glob or an iterable of globs (str), found {value!r}"
        )
    return tuple(items)


def _keys(value: Any) -> tuple[int, int] | None:
    return _range("keys", value)


def _steps(value: Any) -> tuple[int, int] | None:
    return _range("steps", value)


def _time_ns(value: Any) -> tuple[int, int] | None:
    return _range("time_ns", value)


def _integers(value: object) -> tuple[int, int] | None:
    """``value`` as two integers, or None: never a str's characters, and never
    a float or a bool read as an integer."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        return None
    items = list(value)
    if len(items) != 2 or not all(
        isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) for v in items
    ):
        return None
    return int(items[0]), int(items[1])


@attrs.frozen(kw_only=True)
class Filters:
    """Which records of a corpus a replay reads.

    ``hooks``: hook-name globs (``encoder.layer.*.output``, or several in a
    list; empty: every hook);
    ``keys``, ``steps``, ``time_ns``: half-open ``[low, high)`` ranges of the
    descriptor's key, step and capture time (ns since the epoch).
    """

    hooks: tuple[str, ...] = attrs.field(default=(), converter=_hooks)
    keys: tuple[int, int] | None = attrs.field(default=None, converter=_keys)
    steps: tuple[int, int] | None = attrs.field(default=None, converter=_steps)
    time_ns: tuple[int, int] | None = attrs.field(default=None, converter=_time_ns)

    def select_hooks(self, names: Iterable[str]) -> list[str]:
        """The hook names (sorted) that match ``hooks``."""
        names = sorted(set(names))
        if not self.hooks:
            return names
        return [n for n in names if any(fnmatch.fnmatchcase(n, g) for g in self.hooks)]

    def sql(self) -> str:
        """The key/step/time part of a ClickHouse ``WHERE`` (``1`` when empty)."""
        parts = ["1"]
        if self.keys is not None:
            parts.append(f"key >= {self.keys[0]} AND key < {self.keys[1]}")
        if self.steps is not None:
            parts.append(f"step >= {self.steps[0]} AND step < {self.steps[1]}")
        if self.time_ns is not None:
            parts.append(
                f"toUnixTimestamp64Nano(timestamp) >= {self.time_ns[0]} "
                f"AND toUnixTimestamp64Nano(timestamp) < {self.time_ns[1]}"
            )
        return " AND ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-able form (for the ledger and the config hash)."""
        return {
            "hooks": list(self.hooks),
            "keys": list(self.keys) if self.keys else None,
            "steps": list(self.steps) if self.steps else None,
            "time_ns": list(self.time_ns) if self.time_ns else None,
        }


@attrs.frozen(kw_only=True)
class WorkUnit:
    """One piece of a corpus, read, processed and written as a whole.

    ClickHouse units select one hook and an inclusive key range of a raw
    table; Parquet units one row group of one file.  ``rows`` is the number
    of records the plan counted (the filters applied).
    """

    id: str
    source: str
    rows: int
    hook: str | None = None
    key_first: int | None = None
    key_last: int | None = None
    row_group: int | None = None

    def describe(self) -> str:
        """One line for ``--dry-run`` and error messages."""
        if self.hook is not None:
            return (
                f"{self.id}  {self.source}  hook={self.hook}  "
                f"keys {self.key_first}..{self.key_last}  ~{self.rows} rows"
            )
        return f"{self.id}  {self.source}  row group {self.row_group}  ~{self.rows} rows"


def pack_keys(
    hooks: npt.NDArray[np.object_],
    keys: npt.NDArray[np.int64],
    counts: npt.NDArray[np.int64],
    unit_rows: int,
) -> list[tuple[str, int, int, int]]:
    """Cut (hook, key, count) rows, sorted by hook then key, into units:
    (hook, first key, last key, rows).  Per hook, consecutive keys are taken
    until a unit holds at least ``unit_rows`` rows, or the hook ends (one
    key is never split).

    One binary search per unit, not a Python step per key: a corpus of
    millions of keys plans in milliseconds.
    """
    units: list[tuple[str, int, int, int]] = []
    n = len(keys)
    if n == 0:
        return units
    changes = np.flatnonzero(hooks[1:] != hooks[:-1]) + 1
    starts = np.concatenate(([0], changes))
    ends = np.concatenate((changes, [n]))
    for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
        hook = str(hooks[start])
        total = np.cumsum(counts[start:end], dtype=np.int64)
        first, before, last = 0, 0, end - start - 1
        while first <= last:
            # The first key at which the unit reaches unit_rows (or the hook's last).
            cut = int(np.searchsorted(total, before + unit_rows, side="left"))
            cut = min(max(cut, first), last)
            reached = int(total[cut])
            units.append((hook, int(keys[start + first]), int(keys[start + cut]), reached - before))
            first, before = cut + 1, reached
    return units


def unit_id(*parts: object) -> str:
    """A stable id for the unit that ``parts`` (JSON-able) select."""
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()
    return "u" + digest[:16]
