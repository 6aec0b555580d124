"""The stateless processor bench/replay.py replays (imported by name in every
replay worker, as a user's processors module would be)."""

from __future__ import annotations

import numpy as np

from taproute.routing import Layout, Records, RecordSchema, stateless_processor

FLOATS = 256  # 1 KiB payload per record
ACT = Layout("act", [("values", "Array(Float32)", (FLOATS,))])
NORM = Layout("act_norm", [("key", "Int64"), ("seq", "Int64"), ("norm", "Float32")])
SCHEMA = RecordSchema([ACT, NORM])


def norm_rows(keys: np.ndarray, seqs: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The work itself: one L2 norm per record (what the hand-written loop calls too)."""
    rows = np.empty(len(keys), dtype=NORM.dtype)
    rows["key"] = keys
    rows["seq"] = seqs
    rows["norm"] = np.linalg.norm(values, axis=1)
    return rows


@stateless_processor("bench.act_norm", input="act", output="act_norm")
def act_norm(records: Records) -> np.ndarray:
    desc = records.descriptors
    return norm_rows(desc["key"], desc["seq"], records.rows()["values"])
