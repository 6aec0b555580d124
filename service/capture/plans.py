"""Record plans shared between capture contexts, so a context's first hook
call costs what its later calls cost.

Which bytes of an output each record holds, and the descriptor template
for them, depend on the output's shape, its element size, whether it has a
token axis, the layout and the context's real positions (mask or lengths),
never on the values, the keys or the step.  A server sets one capture
context per forward pass, mostly with masks and shapes it has seen before;
building the plan anew (numpy calls and the checked ``make_descriptors``)
at each context's first hook call made that call four times a later one's
(``bench/profiles/hook_p99_<commit>.txt``).  So plans are built once per
distinct key and kept, a bounded number, least recently used first out; a
context then only stamps its keys and step onto the template
(:func:`~taproute.native.keyed_copy`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable

import numpy as np
import numpy.typing as npt

#: A shared record plan: token shape, the records' offsets and lengths in
#: the source, the bytes they cover, and the descriptor templates (keys and
#: step 0) for a packed payload and for one laid out as the source.
SharedPlan = tuple[
    tuple[int, ...] | None,
    npt.NDArray[np.int64],
    npt.NDArray[np.int64],
    int,
    npt.NDArray[np.void],
    npt.NDArray[np.void],
]

#: How many plans a cache keeps by default: each holds 128 bytes per batch
#: row (under 4 MiB in all for 128-row batches); a server sees a handful of
#: shapes times the masks its batcher forms, a decode loop one per step width.
MAX_PLANS = 256


class PlanCache:
    """A bounded, thread-safe map from what determines a record plan to the plan.

    ``get`` returns the plan kept under ``key`` (and marks it recently
    used) or None; ``put`` keeps one, dropping the least recently used plan
    past ``max_plans`` (0: keep nothing, every context plans anew).  The
    values are shared read-only arrays: callers never write into them.
    """

    def __init__(self, max_plans: int = MAX_PLANS) -> None:
        if max_plans < 0:
            raise ValueError(f"max_plans must be >= 0, got {max_plans}")
        self.max_plans = max_plans
        self._plans: OrderedDict[Hashable, SharedPlan] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: Hashable) -> SharedPlan | None:
        """The plan kept under ``key``, or None."""
        with self._lock:
            found = self._plans.get(key)
            if found is None:
                self.misses += 1
                return None
            self._plans.move_to_end(key)
            self.hits += 1
            return found

    def put(self, key: Hashable, plan: SharedPlan) -> None:
        """Keep ``plan`` under ``key`` (within ``max_plans``)."""
        if not self.max_plans:
            return
        with self._lock:
            self._plans[key] = plan
            self._plans.move_to_end(key)
            while len(self._plans) > self.max_plans:
                self._plans.popitem(last=False)

    def clear(self) -> None:
        """Forget every plan (and the hit and miss counts)."""
        with self._lock:
            self._plans.clear()
            self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._plans)


#: The plans every binding shares (a plan is a pure value of its key, so
#: hooks of different runtimes may share it too).
SHARED_PLANS = PlanCache()
