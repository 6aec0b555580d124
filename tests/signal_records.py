"""Build signal-processor inputs from numpy arrays and run a registered
processor on them the way a route does (Records in, rows out; a StateRegion
for stateful ones)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from taproute.native import StateRegion, make_descriptors
from taproute.routing import Layout, RecordBatch, Records
from taproute.routing.processors import REGISTRY


def records_of(
    arrays: Sequence[np.ndarray],
    layout: Layout,
    *,
    hooks: Sequence[str] | str = "layers.0.hook",
    output_ids: Sequence[int] | int = 0,
    keys: Sequence[int] | None = None,
) -> Records:
    """One record per array (each ``[tokens, width]`` float32), back to back."""
    n = len(arrays)
    payload = np.concatenate([np.asarray(a, np.float32).reshape(-1) for a in arrays])
    lengths = [np.asarray(a).size * 4 for a in arrays]
    ids = np.broadcast_to(np.asarray(output_ids), (n,)).astype(np.int64)
    names = [hooks] * (int(ids.max()) + 1) if isinstance(hooks, str) else list(hooks)
    desc = make_descriptors(ids, lengths, keys=np.arange(n) if keys is None else keys, count=n)
    batch = RecordBatch.from_buffer(desc, payload)
    return Records(batch, layout, lambda output_id: names[output_id])


class Stateful:
    """A registered stateful processor with its own K x N state, fed batch by batch."""

    def __init__(self, name: str) -> None:
        self.spec = REGISTRY.get(name)
        assert self.spec.slot is not None and self.spec.key_range is not None
        self.state = StateRegion(self.spec.key_range, self.spec.slot.shape, self.spec.slot.dtype, 1)

    def __call__(self, records: Records) -> np.ndarray | None:
        assert self.spec.key is not None
        keys = np.asarray(self.spec.key(records.descriptors), dtype=np.int64)
        return self.spec.fn(records, keys, self.state)


def stateless(name: str, records: Records) -> np.ndarray:
    return REGISTRY.get(name).fn(records)
