"""The replay driver: validate, plan, run units on a backend, write lanes,
checkpoint, resume.

::

    from taproute.service import ClickHouseCorpus, ParquetDir, run_replay
    report = run_replay(
        source=ClickHouseCorpus.chdb("taproute-data", "activations"),
        processor="demo.head_norms", schema=SCHEMA,
        outputs={"head_norms": ParquetDir("out/head_norms")},
    )

Lifecycle (the document's, in plain order): check the processor, corpus and
outputs; build the feed plan; open or resume the ledger (and the stateful
state); start the backend (``init`` runs per worker); feed units (read by the
driver), collect each unit's rows and write them on their lanes; checkpoint on
the cadence; write a stateful processor's final rows; close the ledger.

What a run is lives in ``config.py``, its checks and opened lanes in
``checked.py``, what it did in ``report.py``; this module is the driver.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from taproute.native import StateRegion
from taproute.routing.processors import ProcessorSpec
from taproute.service.replay.backends import InProcess, open_backend
from taproute.service.replay.checked import CheckedRun
from taproute.service.replay.config import ReplayConfig
from taproute.service.replay.errors import (
    ConfigChanged,
    ReplayConfigError,
    UnitsFailed,
)
from taproute.service.replay.jobs import (
    JobSpec,
    UnitJob,
    UnitOutcome,
    merge_partial,
)
from taproute.service.replay.lanes import (
    describe_targets,
)
from taproute.service.replay.ledger import RunLedger, config_hash
from taproute.service.replay.progress import Progress
from taproute.service.replay.report import ReplayReport
from taproute.service.replay.units import WorkUnit

State = tuple[npt.NDArray[Any], npt.NDArray[np.bool_]]


class _Run(CheckedRun):
    """One execution of a config (the driver's state)."""

    # -- running -----------------------------------------------------------

    def dry_run(self, plan: list[WorkUnit]) -> ReplayReport:
        for lane in self.lanes.values():
            try:
                lane.prepare(create=False)
            except ReplayConfigError:
                raise
            except Exception as exc:
                if "does not exist" not in str(exc):
                    raise
        return ReplayReport(
            run_id=None,
            ledger=None,
            plan=plan,
            lanes=describe_targets(self.targets),
            dry_run=True,
        )

    def run(self, plan: list[WorkUnit], resume: str | None) -> ReplayReport:
        identity = self.identity()
        for lane in self.lanes.values():
            lane.prepare(create=True)
        runs = self.runs_dir()
        if resume is None:
            runs.mkdir(parents=True, exist_ok=True)
            ledger = RunLedger.create(runs, identity, len(plan))
        else:
            ledger = RunLedger.resume(runs, resume, identity)
        try:  # the ledger holds the run's lock: one driver per run
            return self._execute(plan, resume, ledger)
        finally:
            ledger.release()

    def _execute(self, plan: list[WorkUnit], resume: str | None, ledger: RunLedger) -> ReplayReport:
        config = self.config
        state = self._initial_state(ledger)
        job = JobSpec(
            processor=self.spec.name,
            schema=config.schema,
            layout=self.source.layout,
            hooks=tuple(self.source.hooks()),
            params=dict(config.params),
            modules=config.modules,
            on_bind=config.on_bind,
            state_mode="partial" if self.partial else "carry",
            unit_rows=not self.final_rows,
            run_id=ledger.run_id,
            backend=config.backend,
            resumed=resume is not None,
        )
        todo = [u for u in plan if not ledger.done(u.id)]
        progress = Progress(len(todo), sum(u.rows for u in todo), enabled=config.progress)
        started = time.perf_counter()
        backend = open_backend(config.backend, job, config.workers, config.schedule)
        if isinstance(backend, InProcess) and state is not None and backend.job.state is not None:
            backend.job.state.slots[...], backend.job.state.valid[...] = state
            state = None
        self._ledger, self._backend, self._state = ledger, backend, state
        self._written: dict[str, int] = collections.Counter()
        records = 0
        if resume is None:
            ledger.checkpoint(self._current_state())  # the run exists from here on
        try:
            records = self._drive(todo, progress)
            if self.final_rows and not ledger.data["failed"] and not ledger.data["final_written"]:
                self._write_final(job)
        except BaseException as exc:
            ledger.interrupt(exc)
            raise
        else:
            ledger.finish(self._current_state())
        finally:
            progress.close()
            backend.close()
        report = ReplayReport(
            run_id=ledger.run_id,
            ledger=ledger.directory / "ledger.json",
            plan=plan,
            lanes=describe_targets(self.targets),
            units_run=sum(1 for u in todo if ledger.done(u.id)),
            units_skipped=len(plan) - len(todo),
            records=records,
            rows_written=dict(self._written),
            failed=dict(ledger.data["failed"]),
            seconds=time.perf_counter() - started,
        )
        if report.failed:
            error = UnitsFailed(
                ledger.run_id,
                {u: e.splitlines()[0] for u, e in report.failed.items()},
                self.spec.name,
            )
            error.report = report  # type: ignore[attr-defined]
            raise error
        return report

    def _initial_state(self, ledger: RunLedger) -> State | None:
        if not self.stateful:
            return None
        assert isinstance(self.spec, ProcessorSpec) and self.spec.slot and self.spec.key_range
        region = StateRegion(self.spec.key_range, self.spec.slot.shape, self.spec.slot.dtype, 1)
        saved = ledger.load_state()
        if saved is None:
            return region.slots, region.valid
        slots, valid = saved
        if slots.shape != region.slots.shape or slots.dtype != region.slots.dtype:
            # The processor was registered again with another key range or slot
            # (its name, hence the config hash, unchanged): the checkpoint does not fit.
            raise ConfigChanged(
                f"run {ledger.run_id}: its checkpoint state ({ledger.directory}) holds "
                f"{slots.shape[0]} keys x slot {tuple(slots.shape[1:])} {slots.dtype}, but "
                f"processor {self.spec.name!r} now has key_range={self.spec.key_range}, slot "
                f"{tuple(region.slots.shape[1:])} {region.slots.dtype}; resume it with the "
                "processor it started with, or start a new run"
            )
        return slots, valid

    def _current_state(self) -> State | None:
        backend = self._backend
        if isinstance(backend, InProcess) and backend.job.state is not None:
            return backend.job.state.slots, backend.job.state.valid
        return self._state

    def _drive(self, todo: list[WorkUnit], progress: Progress) -> int:
        config, backend = self.config, self._backend
        workers = backend.workers
        units = {u.id: u for u in todo}
        pull = config.schedule == "pull" and workers > 1
        bags: list[collections.deque[WorkUnit]] = (
            [collections.deque(todo)]
            if pull
            else [collections.deque(todo[w::workers]) for w in range(workers)]
        )
        depth = 1 if isinstance(backend, InProcess) else 2
        busy = [0] * len(bags)
        attempts: collections.Counter[str] = collections.Counter()
        read_seconds: dict[str, float] = {}
        owner: dict[str, int] = {}
        records = 0
        since_checkpoint, checkpointed_at = 0, time.monotonic()

        def feed() -> None:
            for b, bag in enumerate(bags):
                limit = depth * (workers if pull else 1)
                while bag and busy[b] < limit:
                    unit = bag.popleft()
                    t0 = time.perf_counter()
                    table = self.source.read(unit)
                    read_seconds[unit.id] = time.perf_counter() - t0
                    owner[unit.id] = b
                    busy[b] += 1
                    backend.submit(None if pull else b, unit.id, table)

        feed()
        while any(busy):
            _, outcome = backend.next_outcome()
            b = owner[outcome.unit_id]
            busy[b] -= 1
            unit = units[outcome.unit_id]
            attempts[unit.id] += 1
            if outcome.error is not None:
                if outcome.retryable and attempts[unit.id] <= config.retries:
                    bags[b].appendleft(unit)
                else:
                    error = outcome.error
                    if self.stateful and not self.partial:
                        # The state is carried from unit to unit in plan order: a unit
                        # run past this one would miss its records, and this one, run
                        # on resume after them, would see theirs (rows unlike an
                        # uninterrupted run's). Stop here; a resume starts from it.
                        left = sum(len(bag) for bag in bags)
                        for bag in bags:
                            bag.clear()
                        first, _, rest = error.partition("\n")
                        error = (
                            f"{first} (the {left} unit(s) after it were not run: a stateful "
                            f"processor's state is carried across units in order)\n{rest}"
                        )
                    self._ledger.record_failure(unit.id, error)
            else:
                records += outcome.records
                self._finish_unit(unit, outcome, attempts[unit.id], read_seconds[unit.id])
                progress.advance(outcome.records)
                since_checkpoint += 1
                if (
                    since_checkpoint >= config.checkpoint_units
                    or time.monotonic() - checkpointed_at >= config.checkpoint_seconds
                ):
                    self._ledger.checkpoint(self._current_state())
                    since_checkpoint, checkpointed_at = 0, time.monotonic()
                if config.on_unit is not None:
                    config.on_unit(unit.id)
            feed()
        return records

    def _finish_unit(
        self, unit: WorkUnit, outcome: UnitOutcome, attempts: int, read: float
    ) -> None:
        t0 = time.perf_counter()
        counts: dict[str, int] = {}
        for lane_name, data in outcome.outputs.items():
            self.lanes[lane_name].write(data, run_id=self._ledger.run_id, part=unit.id)
            counts[lane_name] = data.num_rows
            self._written[lane_name] += data.num_rows
        if outcome.partial is not None:
            assert isinstance(self.spec, ProcessorSpec) and self._state is not None
            region = StateRegion(self.spec.key_range or 1, (1,), "int8", 1)
            region.slots, region.valid = self._state
            merge_partial(self.spec, region, outcome.partial)
            self._state = (region.slots, region.valid)
        self._ledger.record_unit(
            unit.id,
            records=outcome.records,
            outputs=counts,
            attempts=attempts,
            seconds={
                "read": read,
                "process": outcome.process_seconds,
                "write": time.perf_counter() - t0,
            },
            stats=outcome.stats,
        )

    def _write_final(self, job: JobSpec) -> None:
        backend = self._backend
        unit_job = backend.job if isinstance(backend, InProcess) else UnitJob(job)
        state = self._current_state()
        assert state is not None and isinstance(self.spec, ProcessorSpec)
        region = unit_job.new_state()
        region.slots[...], region.valid[...] = state
        data = unit_job.finish_rows(region)
        if data is not None:
            lane = self.spec.output
            self.lanes[lane].write(data, run_id=self._ledger.run_id, part="final")
            self._written[lane] += data.num_rows
        self._ledger.data["final_written"] = True


def run_replay(
    config: ReplayConfig | None = None,
    *,
    resume: str | None = None,
    dry_run: bool = False,
    **settings: Any,
) -> ReplayReport:
    """Run (or, with ``dry_run``, validate and plan) one replay.

    Give a :class:`ReplayConfig`, or its fields as keywords.  Everything is
    checked before the first unit runs.  Raises :class:`UnitsFailed` (with
    ``.report``) when units failed past their retries; the others finished
    and are in the ledger, and ``resume=run_id`` retries the failed ones.
    """
    if config is None:
        config = ReplayConfig(**settings)
    elif settings:
        config = attrs.evolve(config, **settings)
    run = _Run(config)
    plan = config.source.plan(config.unit_rows)
    if dry_run:
        return run.dry_run(plan)
    return run.run(plan, resume)


def config_digest(config: ReplayConfig) -> str:
    """The hash a resume of ``config`` must match (shown by ``--dry-run``)."""
    return config_hash(_Run(config).identity())


__all__: Sequence[str] = ["ReplayConfig", "ReplayReport", "run_replay"]
