"""A processor whose feature store goes down, for the retry-parking crash tests
(registered at import time; a config file names this module).

``TAPROUTE_PARK_MODE`` (read at each call) says how it behaves:

- ``fail``: a batch whose first seq falls in every 9th block of 16
  (``seq // 16 % 9 == 0``) returns ``Failed`` (retryable), the others succeed;
- ``kill_on_retry``: the same, and once :data:`KILL_ARMED` is set the process
  SIGKILLs itself inside the next *retry* of such a batch (mid-retry);
- ``ok``: every batch succeeds;
- ``invalid``: those batches raise ``InvalidInput`` (given up, dead-lettered);
- ``kill``: the process SIGKILLs itself inside any call on such records (a
  rerouted dead letter's copy being processed).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import numpy as np

from taproute.routing import Failed, InvalidInput, Records, stateless_processor
from tests.processors import NORM

_lock = threading.Lock()
_calls: dict[int, int] = {}  # first seq of a batch -> calls seen
#: Set by the producer once its flush returned: the next retry dies.
KILL_ARMED = threading.Event()
#: Set by the producer: the store is back, retries succeed (mode ``fail``).
HEALED = threading.Event()


def failing(first_seq: int) -> bool:
    """Whether the batch starting at ``first_seq`` is one the broken store fails."""
    return first_seq // 16 % 9 == 0


@stateless_processor("park.flaky", input="vec", output="norm")
def flaky(records: Records) -> np.ndarray | Failed:
    mode = os.environ.get("TAPROUTE_PARK_MODE", "ok")
    seqs = records.descriptors["seq"]
    first = int(seqs[0])
    with _lock:
        _calls[first] = calls = _calls.get(first, 0) + 1
    if mode != "ok" and failing(first) and not HEALED.is_set():
        if mode == "invalid":
            raise InvalidInput(f"batch at seq {first}: store says malformed")
        if mode == "kill" or (mode == "kill_on_retry" and calls > 1 and KILL_ARMED.is_set()):
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return Failed(f"feature store down (batch at seq {first})")
    rows = np.empty(len(records), dtype=NORM.dtype)
    rows["key"] = records.descriptors["key"]
    rows["seq"] = seqs
    rows["norm"] = np.linalg.norm(records.rows()["values"], axis=1)
    return rows
