"""Chains at run time: a route's output routed again, under the causal limits.

A route whose output other routes take (:mod:`taproute.routing.chains`)
gets a :class:`ChainLink`.  After the route delivered a call's rows to its
destination, the link turns them into derived records — the rows *are* the
payload (a read-only view of the processor's array, no copy), one record per
row, under the hook ``route:<route>`` — and sends them to the chained routes.

Every derived record's root and depth come from its parent (row ``i`` of a
call that returned one row per input record is derived from record ``i``;
otherwise every row is derived from the call's last record), as arrays.
The sink-wide :class:`CausalGate` admits them with one vectorised pass of
its :class:`~taproute.routing.root_ledger.RootLedger`: refused records are never
sent, spend no token, are counted and reported (``/status``, the dead-letter
store with the payload redacted by default).
"""

from __future__ import annotations

import inspect
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from taproute.native import DESCRIPTOR_DTYPE, BufferLease
from taproute.routing.batch import Lineage, RecordBatch, readonly_bytes
from taproute.routing.causal import (
    CausalLimitExceeded,
    CausalLimits,
    CausalRefusal,
    CausalSnapshot,
    LimitName,
    root_hex,
    root_ids,
)
from taproute.routing.chains import derived_hook
from taproute.routing.failures import FailureCode, FailureHandler, GiveUpLog, RecordFailure
from taproute.routing.hooks import HookRegistry
from taproute.routing.latch import FailureLatch
from taproute.routing.plan import RoutePlan
from taproute.routing.root_ledger import RootLedger
from taproute.routing.schema import RecordSchema

if TYPE_CHECKING:
    from taproute.actors.route_actor import RouteActor


def lineage_of(batch: RecordBatch) -> Lineage:
    """The batch's roots and depths (captured records: their own roots, depth 0)."""
    if batch.lineage is not None:
        return batch.lineage
    return Lineage(root_ids(batch.descriptors), np.zeros(len(batch), np.int32))


class CausalGate:
    """Admits derived records under the causal limits; one per routing sink.

    ``ledger`` may be shared with the next configuration generation so roots
    in flight keep their pinned limits; ``clock`` gives UTC seconds (the
    minute buckets are fixed UTC minutes).
    """

    def __init__(
        self,
        limits: CausalLimits,
        *,
        ledger: RootLedger | None = None,
        clock: Callable[[], float] = time.time,
        on_failure: FailureHandler,
        give_up_log: GiveUpLog,
        latch: FailureLatch,
        recent: int = 64,
    ) -> None:
        self.limits = limits
        self.ledger = ledger if ledger is not None else RootLedger()
        self.clock = clock
        self._on_failure = on_failure
        self._give_up_log = give_up_log
        self._latch = latch
        self.derived = 0
        self.refused_depth = 0
        self.refused_rate = 0
        self.recent: deque[CausalRefusal] = deque(maxlen=recent)

    def snapshot(self) -> CausalSnapshot:
        """Counts, pinned roots and recent refusals, detached."""
        return CausalSnapshot(
            limits=self.limits,
            derived=self.derived,
            refused_depth=self.refused_depth,
            refused_rate=self.refused_rate,
            pinned_roots=len(self.ledger),
            evicted_roots=self.ledger.evicted,
            recent_refusals=tuple(self.recent),
        )

    async def admit(
        self, source: str, targets: tuple[str, ...], batch: RecordBatch
    ) -> RecordBatch | None:
        """The records of ``batch`` (derived, with lineage) the limits accept;
        the rest are counted, reported and handed to the failure handler."""
        assert batch.lineage is not None
        now = self.clock()
        lineage = batch.lineage
        verdict = self.ledger.admit(lineage.roots, lineage.depths, now, self.limits)
        accepted = int(np.count_nonzero(verdict.accepted))
        self.derived += accepted
        if accepted == len(batch):
            return batch
        for limit, mask, bounds in (
            ("depth", verdict.too_deep, verdict.max_depth),
            ("rate", verdict.over_rate, verdict.per_minute),
        ):
            if mask.any():
                await self._refuse(source, targets, batch, mask, bounds, limit, now)  # type: ignore[arg-type]
        if not accepted:
            return None
        return batch.select(np.flatnonzero(verdict.accepted))

    async def _refuse(
        self,
        source: str,
        targets: tuple[str, ...],
        batch: RecordBatch,
        mask: npt.NDArray[np.bool_],
        bounds: npt.NDArray[np.int64],
        limit: LimitName,
        now: float,
    ) -> None:
        positions = np.flatnonzero(mask)
        if limit == "depth":
            self.refused_depth += len(positions)
        else:
            self.refused_rate += len(positions)
        lineage = batch.lineage
        assert lineage is not None
        roots = lineage.roots[positions]
        # One diagnostic per refused root (the last few only: the deque is bounded).
        unique, first = np.unique(roots, return_index=True)
        counts = np.bincount(np.searchsorted(unique, roots), minlength=len(unique))
        keep = self.recent.maxlen or len(unique)
        refusals = [
            CausalRefusal(
                route=source,
                targets=targets,
                root=root_hex(int(unique[u])),
                depth=int(lineage.depths[positions[first[u]]]),
                limit=limit,
                bound=int(bounds[positions[first[u]]]),
                records=int(counts[u]),
                at=now,
            )
            for u in range(max(0, len(unique) - keep), len(unique))
        ]
        self.recent.extend(refusals)
        refused = batch.select(positions)
        redacted = self.limits.redact_payload  # a copy with a lease of its own
        if redacted:
            refused = _redacted(refused)
        failure = RecordFailure(
            route=source,
            processor=None,
            error=CausalLimitExceeded(refusals[-1].message),
            records=refused,
            code=FailureCode.CAUSAL_LIMIT,
            first_failure_at=now,
            last_failure_at=now,
        )
        self._give_up_log(failure)
        try:
            result = self._on_failure(failure)
            if inspect.isawaitable(result):
                await result
        except Exception as exc:
            self._latch.latch(exc, route=source, where="failure handler (dead letters)")
        finally:
            if redacted:
                refused.lease.release()


def _redacted(batch: RecordBatch) -> RecordBatch:
    """The batch's records without their payload (lengths 0, an empty buffer)."""
    descriptors = batch.descriptors.copy()
    descriptors["offset"] = 0
    descriptors["length"] = 0
    return RecordBatch(
        descriptors, np.empty(0, np.uint8), BufferLease(), nbytes=0, lineage=batch.lineage
    )


class ChainLink:
    """Sends one route's output to the routes chained to it, as derived records.

    ``targets``: each chained route and whether the edge is inside a cycle
    (sent without waiting for room: a cycle could otherwise wait on itself;
    the causal limits bound what it carries).
    """

    def __init__(
        self,
        source: str,
        *,
        output_id: int,
        layout_id: int | None,
        targets: Sequence[tuple[RouteActor, bool]],
        gate: CausalGate,
    ) -> None:
        self.source = source
        self.output_id = output_id
        self.layout_id = layout_id
        self.targets = list(targets)
        self.target_names = tuple(t.name for t, _ in targets)
        self.gate = gate

    async def rows(self, parents: RecordBatch, rows: npt.NDArray[np.void]) -> int:
        """Route a processor call's ``rows`` again; returns how many were accepted."""
        assert self.layout_id is not None
        n = len(rows)
        lineage = lineage_of(parents)
        # One row per input record: row i comes from record i; else from the last.
        parent = None if n == len(parents) else np.full(n, len(parents) - 1, np.intp)
        source = parents.descriptors if parent is None else parents.descriptors[parent]
        descriptors = np.zeros(n, dtype=DESCRIPTOR_DTYPE)
        for field in ("key", "step", "seq", "timestamp_ns"):
            descriptors[field] = source[field]
        descriptors["output_id"] = self.output_id
        descriptors["layout_id"] = self.layout_id
        size = rows.dtype.itemsize
        descriptors["offset"] = np.arange(n, dtype=np.int64) * size
        descriptors["length"] = size
        roots = lineage.roots if parent is None else lineage.roots[parent]
        depths = lineage.depths if parent is None else lineage.depths[parent]
        # Rows that view their input's buffer (a processor returning part of its
        # input) keep that buffer's lease, so it is not given back under them.
        borrowed = bool(np.may_share_memory(rows, parents.payload))
        lease = parents.lease if borrowed else BufferLease()
        if borrowed:
            lease.acquire()
        batch = RecordBatch(
            descriptors,
            readonly_bytes(np.ascontiguousarray(rows)),
            lease,
            nbytes=n * size,
            lineage=Lineage(roots, depths + 1),
        )
        try:
            return await self._send(batch)
        finally:
            lease.release()  # this link's own hold; the routes hold theirs

    async def finalized(self, key: int, rows: npt.NDArray[np.void]) -> int:
        """Route a completed key's final rows again: their root is the completion
        itself (a new root: ``route:<route>``, the key, the time), depth 1."""
        completion = np.zeros(1, dtype=DESCRIPTOR_DTYPE)
        completion["output_id"] = self.output_id
        completion["key"] = key
        completion["timestamp_ns"] = time.time_ns()
        parent = RecordBatch(completion, np.empty(0, np.uint8), BufferLease(), nbytes=0)
        try:
            return await self.rows(parent, rows)
        finally:
            parent.lease.release()

    async def records(self, batch: RecordBatch) -> int:
        """Route a forward route's records again (same payload, no copy)."""
        lineage = lineage_of(batch)
        descriptors = batch.descriptors.copy()
        descriptors["output_id"] = self.output_id
        derived = RecordBatch(
            descriptors,
            batch.payload,
            batch.lease,
            nbytes=batch.nbytes,
            lineage=Lineage(lineage.roots, lineage.depths + 1),
            parts=batch.parts,  # the same records, in the same order
        )
        return await self._send(derived)

    async def _send(self, batch: RecordBatch) -> int:
        admitted = await self.gate.admit(self.source, self.target_names, batch)
        if admitted is None:
            return 0
        for target, cyclic in self.targets:
            part: RecordBatch | None = admitted
            if target.planned.route.predicate is not None:
                part = await target.screen_derived(admitted)
            if part is not None and len(part):
                await target.dispatch(part, wait=not cyclic)
        return len(admitted)


def link_chains(
    plan: RoutePlan,
    routes: Sequence[RouteActor],
    hooks: HookRegistry,
    schema: RecordSchema,
    gate: CausalGate,
) -> None:
    """Give every route whose output is routed again its :class:`ChainLink`,
    binding the derived hook ``route:<name>`` its records carry."""
    chains = plan.chains
    for planned, route in zip(plan.routes, routes, strict=True):
        targets = chains.targets[planned.index]
        if not targets:
            continue
        layout = planned.output_layout
        output_id = hooks.bind(
            derived_hook(planned.name), layout=None if layout is None else layout.name
        )
        route.chain = ChainLink(
            planned.name,
            output_id=output_id,
            layout_id=None if layout is None else schema.layout_id(layout.name),
            targets=[(routes[j], (planned.index, j) in chains.cyclic) for j in targets],
            gate=gate,
        )
