"""Records.rows()/tails(): what a processor reads equals the records' bytes,
whether the records lie back to back (a view) or not (a gather)."""

from __future__ import annotations

import numpy as np
import pytest

from taproute.routing import Layout
from taproute.routing.batch import RecordBatch
from taproute.routing.errors import RecordError
from taproute.routing.records import Records
from taproute.service import make_descriptors

ROW = Layout("row", [("key", "Int64"), ("values", "Array(Float32)", (5,))])
TAIL = Layout("tail", [("head", "UInt16"), ("values", "Array(Float32)")])


def _expected(batch: RecordBatch, dtype: np.dtype, skip: int) -> np.ndarray:
    """Record by record, the slow obvious way."""
    return np.array(
        [
            np.frombuffer(batch.payload_of(i)[skip : skip + dtype.itemsize], dtype)[0]
            for i in range(len(batch))
        ],
        dtype=dtype,
    )


def _packed(count: int) -> RecordBatch:
    rows = np.zeros(count, ROW.dtype)
    rows["key"] = np.arange(count) * 7
    rows["values"] = np.arange(count * 5, dtype=np.float32).reshape(count, 5)
    desc = make_descriptors(0, ROW.dtype.itemsize, count=count, keys=rows["key"])
    return RecordBatch.from_buffer(desc, rows.view(np.uint8))


@pytest.mark.parametrize(
    "selection",
    [
        np.arange(1, 64, 2),  # every other record: a gather
        np.arange(63, -1, -1),  # reversed
        np.random.default_rng(3).permutation(64)[:20],  # shuffled subset
        np.array([5]),  # one record: a view
        np.arange(10, 30),  # a back-to-back run in the middle: a view
    ],
)
def test_rows_of_a_selection_equal_its_records(selection):
    batch = _packed(64).select(selection)
    got = Records(batch, ROW).rows()
    assert got.dtype == ROW.dtype and not got.flags.writeable
    np.testing.assert_array_equal(got, _expected(batch, ROW.dtype, 0))
    assert got["key"].tolist() == (selection * 7).tolist()


def test_rows_at_uneven_offsets_are_gathered_exactly():
    # Records at offsets that are no multiple of the row size, with gaps.
    size = ROW.dtype.itemsize
    offsets = np.array([3, size + 10, 3 * size + 1, 5 * size + 7])
    payload = np.random.default_rng(0).integers(0, 256, 6 * size + 8, dtype=np.uint8)
    desc = make_descriptors(0, size, count=4, offsets=offsets)
    batch = RecordBatch.from_buffer(desc, payload)
    got = Records(batch, ROW).rows()
    assert got.tobytes() == b"".join(payload[o : o + size].tobytes() for o in offsets)


def test_tails_of_a_selection_skip_the_prefix():
    elements = 6
    row = np.dtype([("head", "<u2"), ("values", "<f4", (elements,))])
    rows = np.zeros(10, row)
    rows["head"] = np.arange(10)
    rows["values"] = np.arange(60, dtype=np.float32).reshape(10, elements)
    desc = make_descriptors(0, row.itemsize, count=10)
    batch = RecordBatch.from_buffer(desc, rows.view(np.uint8)).select(np.array([8, 2, 5]))
    got = Records(batch, TAIL).tails()
    assert got.shape == (3, elements) and not got.flags.writeable
    np.testing.assert_array_equal(got, rows["values"][[8, 2, 5]])


def test_a_record_outside_the_buffer_is_named():
    # A batch that was never checked (check_batch refuses these at submit).
    size = ROW.dtype.itemsize
    desc = make_descriptors(0, size, count=3, offsets=[0, 2 * size, 5 * size])
    batch = RecordBatch.from_buffer(desc, np.zeros(4 * size, np.uint8))
    with pytest.raises(RecordError, match=rf"record 2: {size} bytes at offset {5 * size}"):
        Records(batch, ROW).rows()


def test_back_to_back_is_one_pass_over_offsets_and_lengths():
    from taproute.native import back_to_back

    size = ROW.dtype.itemsize
    desc = make_descriptors(0, size, count=5, offsets=np.arange(5) * size + 8)
    assert back_to_back(desc, size)
    assert not back_to_back(desc, size + 1)  # lengths differ from the stride
    assert back_to_back(desc[:1], size) and back_to_back(desc[:0], 3)
    gap = desc.copy()
    gap["offset"][3] += 1
    assert not back_to_back(gap, size)
    short = desc.copy()
    short["length"][4] = size - 1  # the last record is shorter: not rows of `size`
    assert not back_to_back(short, size)


def test_rows_are_a_view_exactly_when_the_records_lie_back_to_back():
    batch = _packed(16)
    assert np.shares_memory(Records(batch, ROW).rows(), batch.payload)
    assert np.shares_memory(Records(batch.select(np.arange(4, 9)), ROW).rows(), batch.payload)
    gathered = Records(batch.select(np.array([1, 3, 2])), ROW).rows()
    assert not np.shares_memory(gathered, batch.payload)
    np.testing.assert_array_equal(
        gathered, _expected(batch.select(np.array([1, 3, 2])), ROW.dtype, 0)
    )
