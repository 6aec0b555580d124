"""Captured batches merged into one per wake-up, without copying a payload.

The record worker takes everything the hooks queued since its last wake-up:
on a decoding server that is a dozen small batches (one per hooked module
and forward pass), and each paid the routing sink's matching, the actor
hops, a processor call and the counters on its own, on the loop thread,
while the model thread waited for the GIL (``bench/profiles/serve_load_*``).
Merged, they pay that once.

A batch holds one payload buffer, so batches can only be merged without a
copy when their buffers lie in one larger region someone can hand out a
view of: a :class:`SpansPayloads` (the writer process's
:class:`~taproute.service.sinks.writer.shared_pool.SharedBufferPool`,
whose segments the capture hooks copy into).  The merged batch's payload is
that view, its descriptors the batches' own, offsets moved to it, in the
order the batches were queued.  Its lease (a
:class:`~taproute.native.PartsLease`) takes over each batch's lease, and it
knows which batch each record came from (``RecordBatch.parts``): a
selection of it (a route's part, a record parked for a retry, a table's
part buffered for an insert) holds only the buffers its records lie in, so
what is kept is bounded by what those records hold, as without the merge.
Each batch's lease goes back exactly once, when the last part covering it
is done.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from taproute.native import PartsLease
from taproute.routing.batch import Payload, RecordBatch

#: A run of ``count`` consecutive payloads, one view covering them (None: a
#: run of one, taken as it is) and where each starts in the view.
Run = tuple[int, Payload | None, list[int]]


@runtime_checkable
class SpansPayloads(Protocol):
    """Hands out views covering several payload buffers (no copy)."""

    def spans(self, payloads: Sequence[Payload]) -> Sequence[Run]:
        """``payloads`` cut into runs of consecutive arrays that lie in one
        region, each with one read-only view covering it (see :data:`Run`)."""
        ...


def mergeable(batch: RecordBatch) -> bool:
    """Whether ``batch`` may be merged: captured records (no lineage), non-empty."""
    return batch.lineage is None and len(batch.descriptors) > 0


def _concatenate(arrays: list[np.ndarray]) -> np.ndarray:
    """``arrays`` (1-D, one structured dtype) end to end, as raw records:
    ``np.concatenate`` promotes a structured dtype field by field in Python
    for every array (~25 us each, the merge's main cost in
    ``bench/profiles/serve_load_gil_*``); an opaque record of the same size
    is copied without that."""
    dtype = arrays[0].dtype
    if any(a.dtype != dtype for a in arrays):
        return np.concatenate(arrays)
    record = np.dtype((np.void, dtype.itemsize))
    return np.concatenate([a.view(record) for a in arrays]).view(dtype)


def merge(batches: Sequence[RecordBatch], arena: SpansPayloads) -> tuple[list[RecordBatch], int]:
    """``batches``, each run of consecutive ones whose payloads lie in one
    region of ``arena`` merged into one batch (its payload a view ``arena``
    hands out), in their order: every record, in the order queued; and how
    many of ``batches`` went into merged ones.

    A merged batch takes over its batches' leases: releasing its own (the
    submitter's hold, and every hold taken on it) releases each of theirs
    once, and a selection of it holds only the leases of the batches its
    records came from.  Do not release theirs as well.
    """
    out: list[RecordBatch] = []
    at = merged = 0
    for count, view, starts in arena.spans([batch.payload for batch in batches]):
        run = batches[at : at + count]
        at += count
        if view is None or count == 1:
            out.extend(run)
            continue
        merged += count
        descriptors = _concatenate([batch.descriptors for batch in run])
        counts = [len(batch.descriptors) for batch in run]
        descriptors["offset"] += np.repeat(np.asarray(starts, dtype=np.int64), counts)
        out.append(
            RecordBatch(
                descriptors,
                view,
                PartsLease.merged([batch.lease for batch in run]),
                nbytes=sum(batch.nbytes for batch in run),
                parts=np.repeat(np.arange(count, dtype=np.int32), counts),
            )
        )
    out.extend(batches[at:])  # an arena that left some out: they go on alone
    return out, merged


__all__ = ["Run", "SpansPayloads", "merge", "mergeable"]
