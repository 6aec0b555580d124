"""The batch-processor contract for corpus jobs (the document's
``process_batch``), next to the live stateless/stateful processors that
replay runs unchanged.

::

    @batch_processor("token_counts", input="activations",
                     outputs={"counts": "token_count"}, init=load_vocab)
    def token_counts(batch, *, ctx, params, processor_ctx):
        rows = ...  # a structured array of layout "token_count"
        return [ProcessResult(rows={"counts": rows}, stats={"items": len(rows)},
                              unit_id=batch.unit_id)]

A batch processor gets one work unit at a time as a :class:`ProcessorBatch`
(the same :class:`~taproute.routing.records.Records` view live processors
get, plus the unit's Arrow rows) and returns logical rows by lane name; the
run's config maps lanes to tables or files, and the framework writes them.
Processors never open files or call ClickHouse themselves.

``init(ctx=..., params=..., resume=...)`` (optional) runs once per worker and
returns a dict handed to every call as ``processor_ctx``: reusable in-memory
state (a lookup table, a model), **not a place for I/O** whose effects the
run cannot replay.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import attrs
import numpy as np
import numpy.typing as npt
import pyarrow as pa

from taproute.routing.processors import NamedRegistry
from taproute.routing.records import Records

F = TypeVar("F", bound=Callable[..., Any])


@attrs.frozen(kw_only=True)
class RunContext:
    """What a processor may know about the run it is part of."""

    run_id: str
    worker: int
    backend: str
    resumed: bool


@attrs.frozen(kw_only=True)
class ProcessorBatch:
    """One work unit's records: ``records`` (as live processors see them) and
    ``table`` (the raw Arrow rows: descriptor columns then layout columns)."""

    unit_id: str
    records: Records
    table: pa.Table


@attrs.frozen(kw_only=True)
class ProcessResult:
    """What a batch processor returns for (part of) a unit.

    ``rows`` maps lane names to structured arrays of the lane's layout;
    ``stats`` are counters summed into the ledger; ``ok=False`` with
    ``error`` fails the unit (retried per the run's failure policy).
    """

    ok: bool = True
    rows: Mapping[str, npt.NDArray[np.void]] = attrs.field(factory=dict)
    stats: Mapping[str, int | float] = attrs.field(factory=dict)
    unit_id: str | None = None
    error: str | None = None


@attrs.frozen
class BatchProcessorSpec:
    """A registered batch processor: input layout, lanes -> output layouts, init."""

    name: str
    fn: Callable[..., list[ProcessResult]]
    input: str | None
    outputs: Mapping[str, str]
    init: Callable[..., dict[str, Any]] | None = None


class BatchProcessorRegistry(NamedRegistry[BatchProcessorSpec]):
    """Batch processors by name (a separate namespace from live processors)."""

    kind = "batch processor"


#: Where :func:`batch_processor` registers.
BATCH_REGISTRY = BatchProcessorRegistry()


def batch_processor(
    name: str,
    *,
    input: str | None,
    outputs: Mapping[str, str],
    init: Callable[..., dict[str, Any]] | None = None,
    registry: BatchProcessorRegistry = BATCH_REGISTRY,
) -> Callable[[F], F]:
    """Register ``fn(batch, *, ctx, params, processor_ctx) -> list[ProcessResult]``.

    ``outputs`` maps each lane the processor fills to the layout of its rows.
    """

    def decorate(fn: F) -> F:
        registry.register(BatchProcessorSpec(name, fn, input, dict(outputs), init))
        return fn

    return decorate
