"""The Cython hot path against plain-Python reference implementations."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taproute.native import (
    DESCRIPTOR_DTYPE,
    UNMATCHED,
    BufferLease,
    LeaseError,
    RouteTable,
    StateRegion,
    make_descriptors,
    owner_of,
    partition_keys,
)


def reference_groups(table_map: dict[int, tuple[int, ...]], ids: list[int], n_routes: int):
    groups: dict[int, list[int]] = {}
    for i, oid in enumerate(ids):
        routes = table_map.get(oid, ())
        if not routes:
            groups.setdefault(UNMATCHED, []).append(i)
        for r in routes:
            groups.setdefault(r, []).append(i)
    return groups


@settings(max_examples=200, deadline=None)
@given(
    n_routes=st.integers(1, 6),
    data=st.data(),
)
def test_group_matches_reference(n_routes, data):
    table_map = data.draw(
        st.dictionaries(
            st.integers(0, 300),
            st.sets(st.integers(0, n_routes - 1), max_size=n_routes).map(tuple),
            max_size=12,
        )
    )
    ids = data.draw(st.lists(st.integers(0, 310), min_size=1, max_size=200))
    table = RouteTable(n_routes)
    for oid, routes in table_map.items():
        table.assign(oid, routes)
    got = table.group(make_descriptors(ids, 0))
    expected = reference_groups({k: tuple(sorted(v)) for k, v in table_map.items()}, ids, n_routes)
    assert [r for r, _ in got] == sorted(r for r in expected if r != UNMATCHED) + (
        [UNMATCHED] if UNMATCHED in expected else []
    )
    for route, selection in got:
        positions = list(range(len(ids))) if selection is None else selection.tolist()
        assert positions == expected[route]
        if selection is None:
            assert len(expected[route]) == len(ids)


def test_uniform_batch_builds_no_index_arrays():
    table = RouteTable(3)
    table.assign(7, [2, 0])
    groups = table.group(make_descriptors(7, 0, count=1024))
    assert groups == [(0, None), (2, None)]


def test_reassign_moves_output_to_new_route_set():
    table = RouteTable(2)
    table.assign(1, [0])
    table.assign(1, [0, 1])
    assert table.routes_of(1) == (0, 1)
    table.assign(1, [])
    assert table.routes_of(1) == ()
    assert table.group(make_descriptors([1], 0)) == [(UNMATCHED, None)]


def test_assign_rejects_unknown_route():
    table = RouteTable(2)
    with pytest.raises(ValueError, match="route index 2 out of range"):
        table.assign(0, [2])


@settings(max_examples=200, deadline=None)
@given(
    keys=st.lists(st.integers(-3, 40), max_size=200),
    key_range=st.integers(1, 37),
    owners=st.integers(1, 8),
)
def test_partition_matches_reference(keys, key_range, owners):
    owners = min(owners, key_range)
    per_owner, bad = partition_keys(np.asarray(keys, dtype=np.int64), key_range, owners)
    expected: dict[int, list[int]] = {}
    bad_expected = []
    for i, k in enumerate(keys):
        if 0 <= k < key_range:
            expected.setdefault(k * owners // key_range, []).append(i)
        else:
            bad_expected.append(i)
    for j in range(owners):
        got = [] if per_owner[j] is None else per_owner[j].tolist()
        assert got == expected.get(j, [])
    assert ([] if bad is None else bad.tolist()) == bad_expected
    region = StateRegion(key_range, (2,), "f8", owners)
    for j in range(owners):
        for k in region.owner_keys(j):
            assert owner_of(k, key_range, owners) == j
    assert sum(len(region.owner_keys(j)) for j in range(owners)) == key_range


def test_lease_fires_once_after_last_holder():
    calls = []
    lease = BufferLease(lambda: calls.append("released"))
    lease.acquire(2)
    lease.release()
    lease.release()
    assert calls == [] and lease.holders == 1
    lease.release()
    assert calls == ["released"] and lease.released
    with pytest.raises(LeaseError):
        lease.release()
    with pytest.raises(LeaseError):
        lease.acquire()
    assert calls == ["released"]


def test_make_descriptors_packs_payloads_back_to_back():
    desc = make_descriptors([3, 3, 4], [8, 16, 4], keys=5, steps=[1, 2, 3])
    assert desc.dtype == DESCRIPTOR_DTYPE
    assert desc["offset"].tolist() == [0, 8, 24]
    assert desc["key"].tolist() == [5, 5, 5]
    assert desc["seq"].tolist() == [0, 1, 2]
    assert (desc["timestamp_ns"] > 0).all()


def test_scatter_add_matches_numpy_add_at_and_checks_keys():
    from taproute.native import scatter_add

    rng = np.random.default_rng(0)
    keys = rng.integers(0, 10, 200)
    values = rng.standard_normal((200, 3)).astype(np.float32)
    region = np.zeros((10, 4))
    expected = np.zeros((10, 3))
    np.add.at(expected, keys, values)
    scatter_add(region[:, :3], keys, values)  # a column slice of a wider region
    np.testing.assert_allclose(region[:, :3], expected, rtol=1e-6)
    assert (region[:, 3] == 0).all()
    with pytest.raises(IndexError, match="key 10 of row 0 outside"):
        scatter_add(region[:, :3], np.array([10]), values[:1])
    with pytest.raises(ValueError, match="2 keys but 1 value rows"):
        scatter_add(region[:, :3], np.array([1, 2]), values[:1])
