"""A ClickHouse corpus's plan: keys packed into units by one binary search per
unit give exactly the units of the key-by-key walk they replaced, so unit ids
(and a run's resume) are unchanged."""

from __future__ import annotations

import numpy as np
import pytest

from taproute.service.replay.units import pack_keys


def walked(hooks: list[str], keys: list[int], counts: list[int], unit_rows: int) -> list[tuple]:
    """The plan as it was made before: a Python step per (hook, key)."""
    units = []
    start = rows = 0
    for i, (hook, n) in enumerate(zip(hooks, counts, strict=True)):
        rows += n
        last = i + 1 == len(hooks) or hooks[i + 1] != hook
        if rows >= unit_rows or last:
            units.append((hook, keys[start], keys[i], rows))
            start, rows = i + 1, 0
    return units


def packed(hooks: list[str], keys: list[int], counts: list[int], unit_rows: int) -> list[tuple]:
    return pack_keys(
        np.asarray(hooks, dtype=object),
        np.asarray(keys, dtype=np.int64),
        np.asarray(counts, dtype=np.int64),
        unit_rows,
    )


@pytest.mark.parametrize("seed", range(40))
def test_packing_matches_the_key_by_key_walk(seed):
    rng = np.random.default_rng(seed)
    hooks: list[str] = []
    keys: list[int] = []
    for h in range(int(rng.integers(1, 5))):
        n = int(rng.integers(1, 60))
        hooks += [f"layers.{h}.mlp"] * n
        keys += sorted(rng.choice(10_000, size=n, replace=False).tolist())
    counts = rng.integers(1, 50, size=len(keys)).tolist()
    for unit_rows in (1, 7, 64, 500, 10**6):
        assert packed(hooks, keys, counts, unit_rows) == walked(hooks, keys, counts, unit_rows)


def test_packing_edge_cases():
    assert packed([], [], [], 10) == []
    # One key bigger than a unit is a unit of its own, never split.
    assert packed(["a", "a", "a"], [1, 2, 3], [3, 100, 3], 10) == [
        ("a", 1, 2, 103),
        ("a", 3, 3, 3),
    ]
    # A hook's last keys make a short unit; the next hook starts afresh.
    assert packed(["a", "a", "b", "b"], [5, 6, 5, 6], [4, 4, 4, 4], 5) == [
        ("a", 5, 6, 8),
        ("b", 5, 6, 8),
    ]
    # Keys and rows come back as Python ints (unit ids are JSON of them).
    (unit,) = packed(["a"], [2**40], [3], 1)
    assert all(type(v) is int for v in unit[1:])


@pytest.mark.parametrize("name", ["x`; DROP TABLE head_norms; --", "1st", "db.table", ""])
def test_a_table_name_that_is_not_plain_is_refused_before_anything_runs(chdb_transport, name):
    """``--output 'lane=clickhouse:x`; DROP TABLE t; --'`` was taken (a dry run
    listed it) and the run sent it into a CREATE TABLE between backquotes,
    failing with chDB's INCORRECT_QUERY and a traceback; a corpus layout
    holding a backquote went into ``raw_<layout>`` the same way. Both are
    refused naming the table, as the live sinks' table names are."""
    from taproute.service import ClickHouseCorpus, ClickHouseTable
    from taproute.service.replay.errors import ReplayConfigError
    from taproute.service.replay.lanes import parse_target

    with pytest.raises(ReplayConfigError, match=r"table name .* must be letters, digits and"):
        parse_target(f"clickhouse:{name}") if name else ClickHouseTable(name)
    with pytest.raises(ReplayConfigError, match=r"corpus: table name .* must be letters"):
        ClickHouseCorpus(chdb_transport, "acts", table=name or " ")
    assert ClickHouseTable("replay_ok").table == "replay_ok"
    assert ClickHouseCorpus(chdb_transport, "acts").table == "raw_acts"


@pytest.mark.parametrize(
    ("field", "value", "found"),
    [
        ("keys", "x", "'x'"),
        ("keys", "ab", "'ab'"),
        ("steps", (0, "5"), "(0, '5')"),
        ("keys", (1.5, 3), "(1.5, 3)"),
        ("time_ns", 7, "7"),
        ("keys", (0, 1, 2), "(0, 1, 2)"),
        ("steps", (True, 3), "(True, 3)"),
    ],
)
def test_a_filter_range_that_is_not_two_integers_is_refused_naming_it(field, value, found):
    """``Filters(keys="x")`` was int()'s bare ``ValueError: invalid literal``
    (or tuple unpacking's "not enough values"), naming no field; ``(1.5, 3)``
    was silently read as ``[1, 3)``."""
    from taproute.service.replay.errors import ReplayConfigError
    from taproute.service.replay.units import Filters

    with pytest.raises(ReplayConfigError) as refused:
        Filters(**{field: value})
    assert str(refused.value) == (
        f"Filters {field}: expected a [low, high) pair of integers, found {found}"
    )


def test_an_empty_filter_range_is_refused_naming_it():
    from taproute.service.replay.errors import ReplayConfigError
    from taproute.service.replay.units import Filters

    with pytest.raises(ReplayConfigError) as refused:
        Filters(steps=(3, 3))
    assert str(refused.value) == (
        "Filters steps: expected a [low, high) range with low < high, found [3, 3)"
    )
    assert Filters(keys=(np.int64(0), 8), steps=[1, 3]).as_dict()["keys"] == [0, 8]


def test_one_hook_glob_given_as_a_string_is_one_glob():
    """``Filters(hooks="layers.0.*")`` was split into its characters, and the
    ``*`` among them matched every hook: a replay meant for one layer read
    them all. A string is one glob (as a route's outputs take one name); an
    item that is not a string is refused naming ``hooks``."""
    from taproute.service.replay.errors import ReplayConfigError
    from taproute.service.replay.units import Filters

    names = ["layers.0.q", "layers.1.q", "e"]
    assert Filters(hooks="layers.0.*").hooks == ("layers.0.*",)
    assert Filters(hooks="layers.0.*").select_hooks(names) == ["layers.0.q"]
    assert Filters(hooks=["layers.1.*", "e"]).select_hooks(names) == ["e", "layers.1.q"]
    with pytest.raises(ReplayConfigError) as refused:
        Filters(hooks=["layers.*", 3])
    assert str(refused.value) == (
        "Filters hooks: expected a glob or an iterable of globs (str), found ['layers.*', 3]"
    )
