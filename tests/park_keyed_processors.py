"""A stateful processor whose key 3 fails while its store is down, for the
keyed retry-parking crash test (registered at import time; a config file names
this module).  ``TAPROUTE_PARK_MODE``: ``fail`` (key 3 returns ``Failed``) or
``ok``."""

from __future__ import annotations

import os

import numpy as np

from taproute.routing import Failed, Records, SlotSpec, stateful_processor
from tests.processors import NORM

KEYS = 16
FAILING_KEY = 3


@stateful_processor(
    "park.keyed_count",
    key=lambda d: d["key"] % KEYS,
    key_range=KEYS,
    slot=SlotSpec((1,), "int64"),
    input="vec",
    output="norm",
)
def keyed_count(records: Records, keys: np.ndarray, state) -> np.ndarray | Failed:
    """Per key, counts its records; each row is (key, seq, how many of its key so far)."""
    if os.environ.get("TAPROUTE_PARK_MODE") == "fail" and (keys == FAILING_KEY).any():
        return Failed(f"key {FAILING_KEY}: feature store down")
    rows = np.empty(len(keys), dtype=NORM.dtype)
    for i, key in enumerate(keys.tolist()):  # record by record: the count is its place
        state.slots[key, 0] += 1
        rows[i] = (key, records.descriptors["seq"][i], float(state.slots[key, 0]))
    return rows
