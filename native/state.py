"""The K x N state region of a stateful route.

One array of ``key_range`` slots, each slot an ``N``-element array of the
route's slot shape and dtype, plus a validity bit per slot.  Owner ``j`` of
``n_owners`` holds the contiguous key range ``owner_keys(j)``; only that owner
writes those slots, so no lock is needed.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt


class StateRegion:
    """Slots for keys ``0..key_range-1`` and which of them hold state."""

    __slots__ = ("key_range", "n_owners", "slots", "valid")

    def __init__(
        self,
        key_range: int,
        slot_shape: tuple[int, ...],
        dtype: npt.DTypeLike,
        n_owners: int,
    ) -> None:
        if key_range <= 0:
            raise ValueError(f"key_range must be > 0, got {key_range}")
        if not 1 <= n_owners <= key_range:
            raise ValueError(f"n_owners must be in [1, key_range={key_range}], got {n_owners}")
        self.key_range = key_range
        self.n_owners = n_owners
        #: ``slots[k]`` is the state of key ``k``; zero-initialised.
        self.slots: npt.NDArray[np.generic] = np.zeros((key_range, *slot_shape), dtype=dtype)
        #: ``valid[k]`` is True once a record of key ``k`` was processed.
        self.valid: npt.NDArray[np.bool_] = np.zeros(key_range, dtype=bool)

    def owner_keys(self, owner: int) -> range:
        """The keys owner ``owner`` holds: those with ``k * n_owners // key_range == owner``."""
        k, n = self.key_range, self.n_owners
        return range(-(-owner * k // n), -(-(owner + 1) * k // n))

    @property
    def valid_slots(self) -> int:
        """How many slots hold state."""
        return int(np.count_nonzero(self.valid))
