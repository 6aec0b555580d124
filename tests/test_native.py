"""The Cython hot path against plain-Python reference implementations."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taproute.native import (
    DESCRIPTOR_DTYPE,
    UNMATCHED,
    BufferLease,
    DescriptorFieldError,
    LeaseError,
    RouteTable,
    StateRegion,
    make_descriptors,
    owner_of,
    partition_keys,
    scatter_add,
)
from taproute.native._matcher import MAX_OUTPUT_IDS
from taproute.native._validate import (
    LENGTH_MISMATCH,
    NOT_A_PAYLOAD_LAYOUT,
    OK,
    RANGE_OUTSIDE_BUFFER,
    UNBOUND_OUTPUT_ID,
    UNKNOWN_LAYOUT,
    check_descriptors,
)

INT64 = st.integers(-(2**63), 2**63 - 1)


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


@settings(max_examples=200, deadline=None)
@given(keys=st.sets(st.integers(0, 199), max_size=60), data=st.data())
def test_state_save_restore_puts_back_only_the_saved_keys(keys, data):
    """Whether save copies the keys' span or gathers their rows, restore puts
    back exactly the saved keys' slots and leaves the others (another owner's
    writes in the span meanwhile) as they are."""
    region = StateRegion(200, (3,), "f8", 1)
    region.slots[:] = np.arange(600, dtype="f8").reshape(200, 3)
    saved_keys = np.asarray(sorted(keys), dtype=np.intp)
    before = region.slots.copy()
    saved = region.save(saved_keys, 0)
    written = np.asarray(data.draw(st.lists(st.integers(0, 199), max_size=80)), dtype=np.intp)
    region.slots[written] = -1.0  # the call's writes, and other keys' writes
    region.restore(saved)
    expected = before.copy()
    expected[written] = -1.0
    expected[saved_keys] = before[saved_keys]
    assert np.array_equal(region.slots, expected)


def test_state_save_copies_a_dense_span_whole_and_gathers_sparse_keys():
    region = StateRegion(1000, (2,), "f4", 1)
    dense = np.arange(10, 50, 2)  # 20 keys over a span of 39
    saved = region.save(dense, 0)
    assert saved.first == 10 and len(saved.copy) == 39
    sparse = np.asarray([0, 500, 999])
    saved = region.save(sparse, 0)
    assert saved.first == -1 and len(saved.copy) == 3
    # The buffer is reused: a later, smaller save copies into the same memory.
    assert np.shares_memory(region.save(dense[:5], 0).copy, saved.copy)


def test_state_save_after_drop_spare_copies_into_a_new_buffer():
    """A save abandoned midway may still be writing its buffer: once dropped,
    the owner's next save does not reuse it."""
    region = StateRegion(100, (2,), "f8", 2)
    keys = np.arange(10, 20)
    first = region.save(keys, 0).copy
    region.drop_spare(0)
    assert not np.shares_memory(region.save(keys, 0).copy, first)


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
    # A bad count is named (numpy's "negative dimensions are not allowed" was not).
    with pytest.raises(DescriptorFieldError, match=r"count must be an int >= 0, got -1"):
        make_descriptors(0, 16, count=-1)
    with pytest.raises(DescriptorFieldError, match=r"count must be an int >= 0, got 2.0"):
        make_descriptors(0, 16, count=2.0)  # type: ignore[arg-type]


def test_make_descriptors_refuses_negative_lengths_and_offsets_by_field_and_index():
    """A negative payload length or offset is refused where the descriptors are
    built, naming the field, the record's index and the value (it was accepted
    here and refused only at submit, far from the code that made it)."""
    with pytest.raises(DescriptorFieldError, match=r"lengths\[2\] = -1: a payload length"):
        make_descriptors(0, [8, 8, -1, 4])
    with pytest.raises(DescriptorFieldError, match=r"lengths\[0\] = -16: a payload length"):
        make_descriptors(0, -16, count=3)
    with pytest.raises(DescriptorFieldError, match=r"offsets\[1\] = -8: a payload offset"):
        make_descriptors(0, 8, count=3, offsets=[0, -8, 16])
    with pytest.raises(DescriptorFieldError, match=r"offsets\[0\] = -1: a payload offset"):
        make_descriptors(0, 8, count=2, offsets=-1)
    # Lengths packed back to back past int64 would wrap the default offsets negative.
    with pytest.raises(DescriptorFieldError, match=r"offsets\[2\]: .* overflow"):
        make_descriptors(0, [2**62, 2**62, 1])
    assert make_descriptors(0, [0, 8], offsets=[0, 0])["length"].tolist() == [0, 8]


def test_scatter_add_matches_numpy_add_at_and_checks_keys():

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


# -- native code trusts nothing (issue #10.7) ---------------------------------
#
# The calls below crashed the interpreter (a 64-bit k * n_owners overflowed
# into a negative index, read and written with bounds checks off) or read past
# an array.  They run first in a child process, so a regression fails one test
# instead of killing the test session; the in-process fuzz tests below depend
# on that child having survived.

CRASH_CASES = textwrap.dedent(
    """
    import json, resource
    import numpy as np
    # Bound memory: a table grown to 2**32 output ids must fail, not page in 16 GiB.
    resource.setrlimit(resource.RLIMIT_AS, (6 * 2**30, 6 * 2**30))
    from taproute.native import BufferLease, RouteTable, make_descriptors, owner_of, partition_keys
    from taproute.native._validate import check_descriptors

    def outcome(call):
        try:
            return ["ok", call()]
        except Exception as exc:
            return [type(exc).__name__, str(exc)]

    n = 100_000
    per_owner, bad = partition_keys(np.full(n, 3 * 2**60, np.int64), 2**62, 8)
    results = {
        "partition": [None if p is None else len(p) for p in per_owner] + [bad],
        "owner_of": owner_of(3 * 2**60, 2**62, 8),
        "rules": outcome(lambda: check_descriptors(
            make_descriptors(0, 8, count=4, layout_ids=1), 32, 1,
            np.zeros(2, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))),
        "assign": outcome(lambda: RouteTable(1).assign(2**32 - 1, [0])),
        "lease": outcome(lambda: BufferLease().acquire(2**63 - 1)),
    }
    print(json.dumps(results))
    """
)


@pytest.fixture(scope="module")
def crash_cases():
    child = subprocess.run(
        [sys.executable, "-c", CRASH_CASES], capture_output=True, text=True, timeout=120
    )
    if child.returncode != 0:
        pytest.fail(
            f"native crash cases killed the child (exit {child.returncode}): {child.stderr[-2000:]}"
        )
    return json.loads(child.stdout)


def test_native_crash_cases_raise_or_answer_instead_of_crashing(crash_cases):
    assert crash_cases["partition"] == [None] * 6 + [100_000, None, None]
    assert crash_cases["owner_of"] == 6
    assert crash_cases["rules"] == [
        "ValueError",
        "rule arrays differ in length: fixed_size 2, tail_prefix 0, tail_element 0",
    ]
    assert crash_cases["assign"] == [
        "ValueError",
        f"output_id {2**32 - 1} outside [0, {MAX_OUTPUT_IDS})",
    ]
    assert crash_cases["lease"][0] == "OverflowError"


@settings(max_examples=300, deadline=None)
@given(
    keys=st.lists(INT64, max_size=50),
    key_range=st.integers(1, 2**63 - 1),
    owners=st.integers(1, 64),
    data=st.data(),
)
def test_partition_is_exact_over_all_of_int64(crash_cases, keys, key_range, owners, data):
    owners = min(owners, key_range)
    # Half the keys inside the range, drawn near its top where products overflow 64 bits.
    keys += data.draw(st.lists(st.integers(max(0, key_range - 2**20), key_range - 1), max_size=50))
    per_owner, bad = partition_keys(np.asarray(keys, dtype=np.int64), key_range, owners)
    expected: dict[int, list[int]] = {}
    for i, k in enumerate(keys):
        if 0 <= k < key_range:
            expected.setdefault(k * owners // key_range, []).append(i)
            assert owner_of(k, key_range, owners) == k * owners // key_range
    assert [[] if p is None else p.tolist() for p in per_owner] == [
        expected.get(j, []) for j in range(owners)
    ]
    assert ([] if bad is None else bad.tolist()) == [
        i for i, k in enumerate(keys) if not 0 <= k < key_range
    ]


@settings(max_examples=200, deadline=None)
@given(key=INT64, key_range=INT64, owners=st.integers(-(2**62), 2**62))
def test_partition_arguments_are_checked(crash_cases, key, key_range, owners):
    valid = key_range > 0 and 1 <= owners <= key_range
    if valid and 0 <= key < key_range:
        assert owner_of(key, key_range, owners) == key * owners // key_range
        return
    with pytest.raises(ValueError):
        owner_of(key, key_range, owners)
    if not valid:
        with pytest.raises(ValueError):
            partition_keys(np.asarray([key], np.int64), key_range, owners)


def reference_check(desc, payload_size, bound_ids, fixed, prefix, element):
    """check_descriptors in plain Python (unbounded ints)."""
    total = 0
    for i, d in enumerate(desc.tolist()):
        output_id, layout_id, _flags, _key, _step, _seq, _ts, offset, length = d
        if output_id >= bound_ids:
            return UNBOUND_OUTPUT_ID, i, total
        if offset < 0 or length < 0 or offset + length > payload_size:
            return RANGE_OUTSIDE_BUFFER, i, total
        total = min(total + length, 2**63 - 1)
        if not len(fixed):
            continue
        if layout_id >= len(fixed):
            return UNKNOWN_LAYOUT, i, total
        if fixed[layout_id] < 0:
            return NOT_A_PAYLOAD_LAYOUT, i, total
        if fixed[layout_id] > 0:
            if length != fixed[layout_id]:
                return LENGTH_MISMATCH, i, total
        elif length < prefix[layout_id] or (
            element[layout_id] > 0 and (length - prefix[layout_id]) % element[layout_id]
        ):
            return LENGTH_MISMATCH, i, total
    return OK, -1, total


small_or_huge = st.one_of(st.integers(-4, 64), INT64)


@settings(max_examples=400, deadline=None)
@given(
    records=st.lists(
        st.tuples(st.integers(0, 6), st.integers(0, 5), small_or_huge, small_or_huge),
        max_size=20,
    ),
    payload_size=small_or_huge,
    bound_ids=small_or_huge,
    rules=st.tuples(*[st.lists(st.integers(-2, 24), max_size=5)] * 3),
)
def test_check_descriptors_matches_reference_and_checks_its_arguments(
    crash_cases, records, payload_size, bound_ids, rules
):
    # Built field by field, not with make_descriptors: negative offsets and
    # lengths are what check_descriptors must refuse, and make_descriptors
    # refuses them itself (a producer can still hand submit such an array).
    desc = np.zeros(len(records), dtype=DESCRIPTOR_DTYPE)
    desc["output_id"] = [r[0] for r in records]
    desc["layout_id"] = [r[1] for r in records]
    desc["offset"] = [r[2] for r in records]
    desc["length"] = [r[3] for r in records]
    fixed, prefix, element = (np.asarray(r, np.int64) for r in rules)
    args = (desc, payload_size, bound_ids, fixed, prefix, element)
    lengths = {len(r) for r in rules}
    if (
        len(lengths) > 1
        or payload_size < 0
        or bound_ids < 0
        or (prefix < 0).any()
        or (element < 0).any()
    ):
        with pytest.raises(ValueError):
            check_descriptors(*args)
        return
    assert check_descriptors(*args) == reference_check(*args)


@settings(max_examples=200, deadline=None)
@given(
    keys=st.lists(st.one_of(st.integers(-2, 12), INT64), max_size=30),
    rows=st.integers(0, 10),
    width=st.integers(0, 4),
    wrong_width=st.booleans(),
)
def test_scatter_add_checks_every_key_and_shape(crash_cases, keys, rows, width, wrong_width):
    slots = np.zeros((rows, width + (1 if wrong_width else 0)))
    values = np.ones((len(keys), width), np.float32)
    key_arr = np.asarray(keys, np.int64)
    if wrong_width:
        with pytest.raises(ValueError, match="wide"):
            scatter_add(slots, key_arr, values)
    elif any(not 0 <= k < rows for k in keys):
        with pytest.raises(IndexError, match="outside"):
            scatter_add(slots, key_arr, values)
        assert not slots.any()  # checked before anything is written
    else:
        scatter_add(slots, key_arr, values)
        expected = np.zeros_like(slots)
        np.add.at(expected, key_arr, values)
        np.testing.assert_array_equal(slots, expected)


@settings(max_examples=100, deadline=None)
@given(output_id=st.integers(-(2**40), 2**40), routes=st.lists(st.integers(-3, 5), max_size=4))
def test_route_table_assign_checks_ids_and_routes(crash_cases, output_id, routes):
    table = RouteTable(3)
    if not 0 <= output_id < MAX_OUTPUT_IDS:
        with pytest.raises((ValueError, OverflowError)):
            table.assign(output_id, [0])
        return
    if any(not 0 <= r < 3 for r in routes):
        with pytest.raises(ValueError, match="route index"):
            table.assign(output_id, routes)
        return
    table.assign(output_id, routes)
    assert table.routes_of(output_id) == tuple(sorted(set(routes)))


def test_lease_acquire_cannot_overflow_the_holder_count():
    lease = BufferLease()
    lease.acquire(2**62)
    with pytest.raises(OverflowError, match="overflows the holder count"):
        lease.acquire(2**62)
    assert lease.holders == 2**62 + 1
