"""Processors the chain tests route through (registered on import, as a
config file's ``processors`` list imports them)."""

from __future__ import annotations

import numpy as np

from taproute.routing import InvalidInput, Records, stateless_processor
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
