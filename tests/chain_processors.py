"""Processors the chain tests route through (registered on import, as a
config file's ``processors`` list imports them)."""

from __future__ import annotations

import numpy as np

from taproute.routing import (
    InvalidInput,
    Records,
    SlotSpec,
    stateful_processor,
    stateless_processor,
)
from tests.processors import NORM

#: Rows `chain.spray` emits per call (all derived from the call's last record).
SPRAY_ROWS = 200


@stateless_processor("chain.double", input="norm", output="norm")
def double(records: Records) -> np.ndarray:
    """Each norm row again, its norm doubled (key and seq kept)."""
    rows = np.array(records.rows(), dtype=NORM.dtype)  # a copy: the input is read-only
    rows["norm"] *= 2
    return rows


@stateless_processor("chain.spray", input="vec", output="norm")
def spray(records: Records) -> np.ndarray:
    """SPRAY_ROWS rows per call, whatever the number of records."""
    rows = np.zeros(SPRAY_ROWS, dtype=NORM.dtype)
    rows["key"] = records.descriptors["key"][-1]
    rows["seq"] = np.arange(SPRAY_ROWS)
    return rows


@stateless_processor("chain.picky_odd", input="norm", output="norm")
def picky_odd(records: Records) -> np.ndarray:
    """Its input as is, but a batch holding an odd seq is malformed (InvalidInput)."""
    rows = records.rows()
    if np.any(rows["seq"] % 2 == 1):
        raise InvalidInput("odd seq")
    return np.array(rows)


def _total_row(state, key: int) -> np.ndarray:
    row = np.zeros(1, dtype=NORM.dtype)
    row["key"] = key
    row["seq"] = -1
    row["norm"] = state.slots[key, 0]
    return row


@stateful_processor(
    "chain.norm_total",
    key=lambda d: d["key"] % 16,
    key_range=16,
    slot=SlotSpec((1,), "float64"),
    input="norm",
    output="norm",
    finalize=_total_row,
)
def norm_total(records: Records, keys: np.ndarray, state) -> None:
    """Per key, the sum of the norms it was given; one row when the key completes."""
    np.add.at(state.slots[:, 0], keys, records.rows()["norm"])
