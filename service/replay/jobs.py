"""Running a processor over work units, wherever a worker lives.

A :class:`UnitJob` is built once per worker from plain, picklable settings
(:class:`JobSpec`); it turns a unit's Arrow rows back into records, calls the
registered processor exactly as a live route would (same ``Records`` API, same
output layout validation), and returns the unit's rows per lane as Arrow
tables, plus, for stateful processors on several workers, the unit's partial
state.
"""

from __future__ import annotations

import importlib
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any, Literal

import attrs
import numpy as np
import numpy.typing as npt
import pyarrow as pa

from taproute.native import StateRegion
from taproute.routing.errors import KeyOutOfRange, OutputLayoutMismatch
from taproute.routing.failures import Failed, InvalidInput
from taproute.routing.hooks import HookRegistry
from taproute.routing.processors import REGISTRY, ProcessorKind, ProcessorSpec
from taproute.routing.records import Records
from taproute.routing.schema import RecordSchema
from taproute.routing.validation import check_rows
from taproute.service.replay.contract import (
    BATCH_REGISTRY,
    BatchProcessorSpec,
    ProcessorBatch,
    ProcessResult,
    RunContext,
)
from taproute.service.replay.decode import decode_records
from taproute.service.sinks.clickhouse.columns import rows_table
from taproute.service.sinks.clickhouse.tables import rows_table_spec

#: How a stateful processor's state lives: carried across units in one job
#: (``carry``), or started empty per unit and merged by the driver (``partial``).
StateMode = Literal["carry", "partial"]


@attrs.frozen(kw_only=True)
class JobSpec:
    """Everything a worker needs to rebuild the job (picklable)."""

    processor: str
    schema: RecordSchema
    layout: str
    hooks: tuple[str, ...]
    params: Mapping[str, Any] = attrs.field(factory=dict)
    modules: tuple[str, ...] = ()
    on_bind: tuple[Callable[[str, int], None], ...] = ()
    state_mode: StateMode = "carry"
    #: Stateful processors: write the rows each unit returns (``True``) or
    #: only the final state's rows (``False``).
    unit_rows: bool = True
    run_id: str = ""
    backend: str = "inprocess"
    resumed: bool = False


def import_modules(modules: tuple[str, ...]) -> None:
    """Import the modules that register processors (in a fresh worker)."""
    for name in modules:
        importlib.import_module(name)


def lookup(name: str) -> ProcessorSpec | BatchProcessorSpec:
    """The live or batch processor called ``name`` (live first)."""
    if name in REGISTRY or name not in BATCH_REGISTRY:
        return REGISTRY.get(name)
    return BATCH_REGISTRY.get(name)


def lanes_of(spec: ProcessorSpec | BatchProcessorSpec) -> dict[str, str]:
    """Lane name -> output layout (a live processor has one lane, named after its layout)."""
    if isinstance(spec, BatchProcessorSpec):
        return dict(spec.outputs)
    return {spec.output: spec.output}


@attrs.define
class UnitOutcome:
    """One unit's result as it travels back to the driver."""

    unit_id: str
    outputs: dict[str, pa.Table] = attrs.Factory(dict)
    stats: dict[str, float] = attrs.Factory(dict)
    #: (slots, valid) of this unit alone (``partial`` state mode), else None.
    partial: tuple[npt.NDArray[Any], npt.NDArray[np.bool_]] | None = None
    records: int = 0
    process_seconds: float = 0.0
    error: str | None = None
    retryable: bool = True


class UnitJob:
    """A processor ready to run over units (one per worker)."""

    def __init__(self, job: JobSpec, *, worker: int = 0) -> None:
        import_modules(job.modules)
        self.job = job
        self.spec = lookup(job.processor)
        self.schema = job.schema
        self.layout = job.schema.layout(job.layout)
        self.layout_id = job.schema.layout_id(job.layout)
        self.lanes = {lane: job.schema.layout(name) for lane, name in lanes_of(self.spec).items()}
        self.hooks = HookRegistry()
        for listener in job.on_bind:
            self.hooks.subscribe(listener)
        for name in job.hooks:
            self.hooks.bind(name, layout=job.layout)
        self.hook_names = list(job.hooks)
        self.ctx = RunContext(
            run_id=job.run_id, worker=worker, backend=job.backend, resumed=job.resumed
        )
        self.processor_ctx: dict[str, Any] = {}
        if isinstance(self.spec, BatchProcessorSpec) and self.spec.init is not None:
            self.processor_ctx = dict(
                self.spec.init(ctx=self.ctx, params=job.params, resume=job.resumed)
            )
        self.state: StateRegion | None = None
        if isinstance(self.spec, ProcessorSpec) and self.spec.kind is ProcessorKind.STATEFUL:
            self.state = self.new_state()

    def new_state(self) -> StateRegion:
        """An empty K x N region of this stateful processor."""
        spec = self.spec
        assert isinstance(spec, ProcessorSpec) and spec.slot and spec.key_range
        return StateRegion(spec.key_range, spec.slot.shape, spec.slot.dtype, 1)

    def run(self, unit_id: str, table: pa.Table) -> UnitOutcome:
        """Process one unit; a failure comes back in the outcome, never raised."""
        started = time.perf_counter()
        outcome = UnitOutcome(unit_id, records=table.num_rows)
        saved = None
        if self.state is not None and self.job.state_mode == "carry":
            saved = (self.state.slots.copy(), self.state.valid.copy())
        try:
            self._run(unit_id, table, outcome)
        except (InvalidInput, OutputLayoutMismatch, KeyOutOfRange) as exc:
            outcome.error, outcome.retryable = f"{type(exc).__name__}: {exc}", False
        except Exception as exc:
            outcome.error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        if outcome.error is not None:
            outcome.outputs, outcome.partial = {}, None
            if saved is not None and self.state is not None:  # the unit left no trace
                self.state.slots[...], self.state.valid[...] = saved
        outcome.process_seconds = time.perf_counter() - started
        return outcome

    def _records(self, table: pa.Table, unit_id: str) -> Records:
        batch = decode_records(
            table, self.layout, self.layout_id, self.hook_names, where=f"work unit {unit_id}"
        )
        return Records(batch, self.layout, self.hooks.name_of)

    def _run(self, unit_id: str, table: pa.Table, outcome: UnitOutcome) -> None:
        records = self._records(table, unit_id)
        spec = self.spec
        where = f"replay {self.job.run_id or '(dry run)'}, unit {unit_id}"
        if isinstance(spec, BatchProcessorSpec):
            batch = ProcessorBatch(unit_id=unit_id, records=records, table=table)
            results = spec.fn(
                batch, ctx=self.ctx, params=self.job.params, processor_ctx=self.processor_ctx
            )
            self._collect(results, outcome, where)
            return
        argument: Any = records if spec.input is not None else records.batch
        if spec.kind is ProcessorKind.STATELESS:
            self._emit(outcome, spec.output, spec.fn(argument), where)
            return
        keys = self.keys(records)
        state = self.state if self.job.state_mode == "carry" else self.new_state()
        assert state is not None
        rows = spec.fn(argument, keys, state)
        state.valid[keys] = True
        if self.job.unit_rows:
            self._emit(outcome, spec.output, rows, where)
        elif rows is not None and not isinstance(rows, Failed):
            check_rows(rows, self.lanes[spec.output], route=where, processor=spec.name)
        elif isinstance(rows, Failed):
            raise RuntimeError(f"processor returned Failed({rows.reason!r})")
        if self.job.state_mode == "partial":
            outcome.partial = (state.slots, state.valid)

    def keys(self, records: Records) -> npt.NDArray[np.int64]:
        """The stateful processor's keys for ``records``, checked against ``[0, K)``."""
        spec = self.spec
        assert isinstance(spec, ProcessorSpec) and spec.key is not None
        assert spec.key_range is not None
        keys = np.ascontiguousarray(spec.key(records.descriptors), dtype=np.int64)
        if keys.shape != (len(records),):
            raise KeyOutOfRange(
                f"processor {spec.name!r}: key function returned shape {keys.shape}, "
                f"expected ({len(records)},)"
            )
        bad = np.flatnonzero((keys < 0) | (keys >= spec.key_range))
        if len(bad):
            raise KeyOutOfRange(
                f"processor {spec.name!r}: key {int(keys[bad[0]])} of record {int(bad[0])} is "
                f"outside [0, {spec.key_range}); {len(bad)} record(s) of the unit"
            )
        return keys

    def _emit(self, outcome: UnitOutcome, lane: str, rows: Any, where: str) -> None:
        if isinstance(rows, Failed):
            raise RuntimeError(f"processor returned Failed({rows.reason!r})")
        if rows is None:
            return
        layout = self.lanes[lane]
        checked = check_rows(rows, layout, route=where, processor=self.job.processor)
        table = rows_table(checked, layout, rows_table_spec(layout, lane))
        previous = outcome.outputs.get(lane)
        outcome.outputs[lane] = table if previous is None else pa.concat_tables([previous, table])

    def _collect(self, results: Any, outcome: UnitOutcome, where: str) -> None:
        if not isinstance(results, list) or not all(isinstance(r, ProcessResult) for r in results):
            raise OutputLayoutMismatch(
                f"{where}: batch processor {self.job.processor!r} must return "
                f"list[ProcessResult], returned {type(results).__name__}"
            )
        for result in results:
            if not result.ok:
                raise RuntimeError(result.error or "processor returned ok=False")
            for lane, rows in result.rows.items():
                if lane not in self.lanes:
                    raise OutputLayoutMismatch(
                        f"{where}: batch processor {self.job.processor!r} returned rows for "
                        f"lane {lane!r}; its lanes are {sorted(self.lanes)}"
                    )
                self._emit(outcome, lane, rows, where)
            for name, value in result.stats.items():
                outcome.stats[name] = outcome.stats.get(name, 0) + value

    def finish_rows(self, state: StateRegion) -> pa.Table | None:
        """The final rows of a stateful processor's state (its ``finish``)."""
        spec = self.spec
        assert isinstance(spec, ProcessorSpec) and spec.finish is not None
        keys = np.flatnonzero(state.valid).astype(np.int64)
        rows = spec.finish(state, keys)
        if rows is None:
            return None
        layout = self.lanes[spec.output]
        checked = check_rows(
            rows, layout, route=f"replay {self.job.run_id}, finish", processor=spec.name
        )
        return rows_table(checked, layout, rows_table_spec(layout, spec.output))


def merge_partial(
    spec: ProcessorSpec,
    state: StateRegion,
    partial: tuple[npt.NDArray[Any], npt.NDArray[np.bool_]],
) -> None:
    """Fold a unit's partial state into ``state`` with the processor's ``merge``."""
    assert spec.merge is not None
    slots, valid = partial
    both = np.flatnonzero(valid & state.valid)
    only = np.flatnonzero(valid & ~state.valid)
    if len(both):
        state.slots[both] = spec.merge(state.slots[both], slots[both])
    if len(only):
        state.slots[only] = slots[only]
    state.valid |= valid
