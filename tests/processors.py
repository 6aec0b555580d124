"""Processors and layouts the tests route through, registered at import time
as a user's module would."""

from __future__ import annotations

import threading

import numpy as np

from taproute.routing import (
    Layout,
    Records,
    RecordSchema,
    SlotSpec,
    stateful_processor,
    stateless_processor,
)

VEC = Layout("vec", [("values", "Array(Float32)", (4,))])
NORM = Layout("norm", [("key", "Int64"), ("seq", "Int64"), ("norm", "Float32")])
SUM = Layout("sum", [("key", "Int64"), ("total", "Array(Float64)", (4,)), ("count", "UInt32")])
TOKENS = Layout("tokens", [("position", "UInt32"), ("hidden", "Array(Float32)")])
SCHEMA = RecordSchema([VEC, NORM, SUM, TOKENS])

#: ``VEC`` and ``NORM`` as a config file writes them (``[[layouts]]`` tables).
LAYOUTS_TOML = """\
[[layouts]]
name = "vec"
columns = [{ name = "values", type = "Array(Float32)", shape = [4] }]

[[layouts]]
name = "norm"
columns = [
  { name = "key", type = "Int64" },
  { name = "seq", type = "Int64" },
  { name = "norm", type = "Float32" },
]
"""

KEY_RANGE = 16


@stateless_processor("test.norms", input="vec", output="norm")
def norms(records: Records) -> np.ndarray:
    """One row per record: its key, seq and L2 norm."""
    rows = np.empty(len(records), dtype=NORM.dtype)
    rows["key"] = records.descriptors["key"]
    rows["seq"] = records.descriptors["seq"]
    rows["norm"] = np.linalg.norm(records.rows()["values"], axis=1)
    return rows


@stateful_processor(
    "test.running_sum",
    key=lambda d: d["key"] % KEY_RANGE,
    key_range=KEY_RANGE,
    slot=SlotSpec((5,), "float64"),
    input="vec",
    output="sum",
)
def running_sum(records: Records, keys: np.ndarray, state) -> np.ndarray:
    """Per key: running total of the vectors (slot[:4]) and count (slot[4])."""
    values = records.rows()["values"].astype(np.float64)
    np.add.at(state.slots[:, :4], keys, values)
    np.add.at(state.slots[:, 4], keys, 1)
    rows = np.empty(len(keys), dtype=SUM.dtype)
    rows["key"] = keys
    rows["total"] = state.slots[keys, :4]
    rows["count"] = state.slots[keys, 4]
    return rows


@stateless_processor("test.wrong_layout", input="vec", output="norm")
def wrong_layout(records: Records) -> np.ndarray:
    """Returns rows with a Float64 norm where the layout says Float32."""
    rows = np.zeros(len(records), dtype=[("key", "<i8"), ("seq", "<i8"), ("norm", "<f8")])
    return rows


@stateless_processor("test.raises", input="vec", output="norm")
def raises(records: Records) -> np.ndarray:
    raise ValueError("malformed input")


class Rendezvous:
    """Lets a test prove N processor calls are in flight at the same time."""

    def __init__(self, parties: int) -> None:
        self.barrier = threading.Barrier(parties, timeout=60)
        self.max_in_flight = 0
        self._in_flight = 0
        self._lock = threading.Lock()

    def arrive(self) -> None:
        with self._lock:
            self._in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self._in_flight)
        try:
            self.barrier.wait()  # raises BrokenBarrierError unless all parties arrive
        finally:
            with self._lock:
                self._in_flight -= 1


RENDEZVOUS: dict[str, Rendezvous] = {}


@stateless_processor("test.rendezvous", input="vec", output="norm", needs_thread=True)
def rendezvous(records: Records) -> np.ndarray:
    RENDEZVOUS["current"].arrive()
    return norms(records)


ORDER_LOG: dict[int, list[int]] = {}
ORDER_LOCK = threading.Lock()


@stateful_processor(
    "test.order_log",
    key=lambda d: d["key"],
    key_range=KEY_RANGE,
    slot=SlotSpec((1,), "int64"),
    input="vec",
    output="norm",
)
def order_log(records: Records, keys: np.ndarray, state) -> None:
    """Logs each key's seqs in processing order; the slot keeps the last seq."""
    seqs = records.descriptors["seq"]
    for key, seq in zip(keys.tolist(), seqs.tolist(), strict=True):
        with ORDER_LOCK:
            ORDER_LOG.setdefault(key, []).append(seq)
        state.slots[key, 0] = seq
    return None
