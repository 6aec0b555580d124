"""What producers hand in, checked: batches, single records, request keys, hook bindings.

One :class:`Intake` per hook registry and schema.  Every check is done here,
before anything is accepted; what passes is ready to queue (a
:class:`~taproute.routing.batch.RecordBatch` holding the producer's buffer,
uncopied, or one record's descriptor fields and bytes).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from taproute.native import BufferLease, check_int64
from taproute.routing.batch import (
    Descriptors,
    RecordBatch,
    checked_release,
    readonly_bytes,
    taken_descriptors,
)
from taproute.routing.errors import UnboundOutputId
from taproute.routing.hooks import HookRegistry
from taproute.routing.payload_dtypes import batch_mismatch, single_payload
from taproute.routing.schema import RecordSchema
from taproute.routing.validation import check_batch

#: One record's descriptor fields, without offset and length:
#: (output_id, layout_id, flags, key, step, seq, timestamp_ns).
RecordRow = tuple[int, int, int, int, int, int, int]


class Intake:
    """Checks what producers submit against ``hooks`` and ``schema`` (None: no
    layout checks).  Thread-safe: any producer thread may call it."""

    def __init__(self, hooks: HookRegistry, schema: RecordSchema | None) -> None:
        self.hooks = hooks
        self.schema = schema
        self._seq = itertools.count()
        self._record_rules: dict[int, tuple[int, int, int, int]] = {}

    def bind_hook(self, name: str, *, layout: str | None = None) -> int:
        """The output_id for hook ``name``; an unknown ``layout`` is refused now."""
        if layout is not None and self.schema is not None:
            self.schema.layout_id(layout)  # unknown layout: raise now
        return self.hooks.bind(name, layout=layout)

    def batch(
        self, descriptors: Any, payload: Any, release: Callable[[], object] | None
    ) -> RecordBatch:
        """A batch of ``descriptors`` (copied: the producer may reuse its array)
        over ``payload`` (not copied), or raise
        (:func:`~taproute.routing.validation.check_batch`); ``release`` is not
        called when it is refused."""
        release = checked_release(release)
        desc = taken_descriptors(descriptors)
        data = readonly_bytes(payload)
        nbytes = self._check(desc, len(data))
        if isinstance(payload, np.ndarray):
            self._check_dtype(desc, payload.dtype)
        return RecordBatch(desc, data, BufferLease(release), nbytes)

    def _check_dtype(self, desc: Descriptors, dtype: np.dtype[Any]) -> None:
        """Refuse a payload array whose dtype is not its records' layouts' values
        (before the batch is taken: nothing accepted is lost)."""
        if self.schema is None:
            return
        error = batch_mismatch(
            dtype,
            desc["layout_id"],
            self.schema,
            lambda i: f"record {i} (hook {self.hooks.name_of(int(desc['output_id'][i]))!r})",
        )
        if error is not None:
            raise error

    def check(self, batch: RecordBatch) -> int:
        """Refuse ``batch`` whole unless every record of it can be routed; return
        its payload bytes (for a batch built elsewhere than :meth:`batch`)."""
        nbytes = self._check(batch.descriptors, len(batch.payload))
        if batch.source_dtype is not None:
            self._check_dtype(batch.descriptors, batch.source_dtype)
        return nbytes

    def _check(self, desc: Descriptors, payload_size: int) -> int:
        return check_batch(
            desc,
            payload_size,
            bound_ids=len(self.hooks),
            schema=self.schema,
            hook_name=self.hooks.name_of,
        )

    def record(
        self,
        output_id: int,
        payload: Any,
        *,
        key: int,
        step: int,
        seq: int | None,
        timestamp_ns: int | None,
    ) -> tuple[RecordRow, bytes]:
        """One record's descriptor fields and its bytes (copied), or raise.

        The layout is the one its hook was bound with (layout 0 otherwise).
        """
        layout_id, fixed, prefix, element = self._rule(output_id)
        if isinstance(payload, np.ndarray):
            if self.schema is not None:
                layout = self.schema.by_id(layout_id)
                payload = single_payload(payload, layout, hook=self.hooks.name_of(output_id))
            if not payload.flags.c_contiguous:  # copied below anyway: as its values, C order
                payload = np.ascontiguousarray(payload)
        data = payload if isinstance(payload, bytes) else readonly_bytes(payload).tobytes()
        size = len(data)
        # RecordSchema.size_rule's check, inlined on cached ints: this runs per record.
        if (fixed and size != fixed) or (element and (size < prefix or (size - prefix) % element)):
            assert self.schema is not None
            raise self.schema.size_rule(layout_id).mismatch(
                size, hook=self.hooks.name_of(output_id)
            )
        # Checked here, at the call: a field the descriptor can't hold must not
        # reach the coalesced batch, where it would take the others down with it.
        row = (
            output_id,
            layout_id,
            0,
            check_int64("key", key),
            check_int64("step", step),
            next(self._seq) if seq is None else check_int64("seq", seq),
            time.time_ns() if timestamp_ns is None else check_int64("timestamp_ns", timestamp_ns),
        )
        return row, data

    def _rule(self, output_id: int) -> tuple[int, int, int, int]:
        """The hook's :meth:`RecordSchema.size_rule` as plain ints, cached per output_id."""
        rule = self._record_rules.get(output_id)
        if rule is not None:
            return rule
        if not isinstance(output_id, (int, np.integer)) or not 0 <= output_id < len(self.hooks):
            hint = ""
            if isinstance(output_id, str):
                hint = "; an output_id is the int bind_hook returned, not the hook's name"
            raise UnboundOutputId(
                f"output_id {output_id!r} was never bound with bind_hook "
                f"({len(self.hooks)} bound){hint}"
            )
        layout_name = self.hooks.layout_of(output_id)
        if self.schema is None:
            rule = (0, 0, 0, 0)
        else:
            layout_id = 0 if layout_name is None else self.schema.layout_id(layout_name)
            rule = self.schema.size_rule(layout_id).parts
        self._record_rules[output_id] = rule
        return rule
