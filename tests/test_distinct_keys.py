"""distinct_keys: what np.unique returns, by either of its two paths."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from taproute.actors.keys import distinct_keys


@given(
    st.integers(1, 5000).flatmap(
        lambda key_range: st.tuples(
            st.just(key_range), st.lists(st.integers(0, key_range - 1), max_size=600)
        )
    )
)
def test_distinct_keys_equal_np_unique(case):
    key_range, values = case
    keys = np.array(values, dtype=np.int64)
    got = distinct_keys(keys, key_range)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, np.unique(keys))


def test_both_paths_on_one_batch():
    keys = np.random.default_rng(1).integers(0, 4096, 4096)
    small = distinct_keys(keys, 4096)  # a flag per key
    large = distinct_keys(keys, 1 << 30)  # one sort
    np.testing.assert_array_equal(small, np.unique(keys))
    np.testing.assert_array_equal(large, np.unique(keys))
