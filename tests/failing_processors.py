"""Processors that fail for real, each in its own way (registered at import time)."""

from __future__ import annotations

import threading
import time

import numpy as np
import trio

from taproute.routing import (
    Failed,
    InvalidInput,
    Records,
    SlotSpec,
    stateful_processor,
    stateless_processor,
)
from tests.processors import KEY_RANGE, NORM, norms


class Script:
    """Shared, thread-safe knobs and logs the failing processors read and write."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self.lock:
            self.calls: list[float] = []  # trio clock time of each call
            self.failures_left: dict[int, int] = {}  # key -> transient failures still to give
            self.broken = False
            self.release_hang = threading.Event()
            self.log: list[tuple[int, int]] = []  # (key, seq) processed, in order
            self.bad_seqs: set[int] = set()
            self.transient_seqs: dict[int, int] = {}


SCRIPT = Script()


def now() -> float:
    return trio.from_thread.run_sync(trio.current_time)


@stateless_processor("fail.invalid_when_broken", input="vec", output="norm")
def invalid_when_broken(records: Records) -> np.ndarray:
    if SCRIPT.broken:
        raise InvalidInput("values out of range")
    return norms(records)


@stateless_processor("fail.always_transient", input="vec", output="norm", needs_thread=True)
def always_transient(records: Records) -> Failed:
    with SCRIPT.lock:
        SCRIPT.calls.append(now())
    return Failed("feature store restarting")


@stateless_processor("fail.transient_then_ok", input="vec", output="norm", needs_thread=True)
def transient_then_ok(records: Records):
    with SCRIPT.lock:
        SCRIPT.calls.append(now())
        left = SCRIPT.failures_left.get(-1, 0)
        if left:
            SCRIPT.failures_left[-1] = left - 1
            return Failed("warming up")
    return norms(records)


@stateless_processor("fail.hangs", input="vec", output="norm", needs_thread=True)
def hangs(records: Records) -> np.ndarray:
    SCRIPT.release_hang.wait(30)
    return norms(records)


@stateless_processor("fail.takes_a_second", input="vec", output="norm", needs_thread=True)
def takes_a_second(records: Records) -> np.ndarray:
    """A slow call: each takes 1 s of real time, measured from its own start
    (past a 0.2 s deadline, well within the default 5 s), whenever it starts."""
    time.sleep(1.0)  # the call's own duration, not synchronisation
    return norms(records)


@stateless_processor("fail.panics", input="vec", output="norm")
def panics(records: Records) -> np.ndarray:
    raise ZeroDivisionError("division by zero in the feature code")


@stateless_processor("fail.wrong_layout", input="vec", output="norm")
def wrong_layout(records: Records) -> np.ndarray:
    return np.zeros(len(records), dtype=[("key", "<i8")])


@stateless_processor("fail.by_seq", input="vec", output="norm")
def by_seq(records: Records):
    """Fails for scripted seqs: InvalidInput for bad ones, Failed n times for transient ones."""
    seqs = records.descriptors["seq"].tolist()
    with SCRIPT.lock:
        if any(s in SCRIPT.bad_seqs for s in seqs):
            raise InvalidInput(f"bad record among seqs {seqs[:3]}")
        for s in seqs:
            if SCRIPT.transient_seqs.get(s, 0) > 0:
                SCRIPT.transient_seqs[s] -= 1
                return Failed(f"seq {s} not ready")
    return norms(records)


@stateful_processor(
    "fail.keyed_log",
    key=lambda d: d["key"],
    key_range=KEY_RANGE,
    slot=SlotSpec((1,), "int64"),
    input="vec",
    output="norm",
)
def keyed_log(records: Records, keys: np.ndarray, state) -> np.ndarray:
    """Logs (key, seq) in processing order; keys in failures_left fail transiently first."""
    with SCRIPT.lock:
        for key in set(keys.tolist()):
            if SCRIPT.failures_left.get(key, 0) > 0:
                SCRIPT.failures_left[key] -= 1
                return Failed(f"key {key} not ready")
        for key, seq in zip(keys.tolist(), records.descriptors["seq"].tolist(), strict=True):
            SCRIPT.log.append((key, seq))
    rows = np.zeros(len(keys), dtype=NORM.dtype)
    rows["key"] = keys
    rows["seq"] = records.descriptors["seq"]
    return rows


@stateless_processor("fail.connection_then_ok", input="vec", output="norm")
def connection_then_ok(records: Records) -> np.ndarray:
    """Raises ConnectionError (a transient error) failures_left[-2] times, then works."""
    with SCRIPT.lock:
        left = SCRIPT.failures_left.get(-2, 0)
        if left:
            SCRIPT.failures_left[-2] = left - 1
            raise ConnectionError("feature store connection reset")
    return norms(records)


@stateless_processor("fail.type_error", input="vec", output="norm")
def type_error(records: Records) -> np.ndarray:
    """A bug in the processor's own code: a panic."""
    return records + 1  # type: ignore[operator,no-any-return]


@stateful_processor(
    "fail.running_sum",
    key=lambda d: d["key"],
    key_range=KEY_RANGE,
    slot=SlotSpec((1,), "int64"),
    input="vec",
    output="norm",
)
def running_sum(records: Records, keys: np.ndarray, state) -> np.ndarray:
    """state[k] += 1 per record, record by record; a record of key 5 is malformed."""
    rows = np.zeros(len(keys), dtype=NORM.dtype)
    for i, key in enumerate(keys.tolist()):
        if key == 5:
            raise InvalidInput(f"record {i}: key 5 is malformed")
        state.slots[key] += 1
        rows[i] = (key, records.descriptors["seq"][i], float(state.slots[key][0]))
    return rows
