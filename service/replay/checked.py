"""A replay run's configuration checked and its output lanes opened, before
anything runs: the processor's input layout against the corpus, the backend,
schedule and workers, a stateful processor's merge/finish, every output lane
resolved to a target.  :mod:`~taproute.service.replay.runner` drives it.
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

from taproute.routing.processors import ProcessorKind, ProcessorSpec
from taproute.service.replay.config import ReplayConfig
from taproute.service.replay.corpus import ClickHouseCorpus
from taproute.service.replay.errors import LayoutMismatch, MergeRequired, ReplayConfigError
from taproute.service.replay.jobs import import_modules, lanes_of, lookup
from taproute.service.replay.lanes import (
    ClickHouseTable,
    LaneTarget,
    ParquetDir,
    Redo,
    describe_targets,
    open_lane,
)
from taproute.service.sinks.clickhouse.transport import ChdbTransport


class CheckedRun:
    """A replay config, checked (processor, corpus, backend, outputs) and with
    its lanes opened; what decides its outputs (:meth:`identity`) and where
    its ledgers live (:meth:`runs_dir`).  Raises at construction, before
    anything runs."""

    def __init__(self, config: ReplayConfig) -> None:
        self.config = config
        import_modules(config.modules)
        self.spec = lookup(config.processor)
        self.source = config.source
        self.transport = config.clickhouse
        if self.transport is None and isinstance(self.source, ClickHouseCorpus):
            self.transport = self.source.transport
        self.stateful = (
            isinstance(self.spec, ProcessorSpec) and self.spec.kind is ProcessorKind.STATEFUL
        )
        self.final_rows = self._final_mode()
        self.partial = self.stateful and config.backend != "inprocess"
        self._check()
        layouts = lanes_of(self.spec)
        self.targets = self._resolve_targets(layouts)
        redo = self._redo()
        self.lanes = {
            lane: open_lane(
                lane,
                target,
                config.schema.layout(layouts[lane]),
                self.transport,
                redo=redo[target.table] if isinstance(target, ClickHouseTable) else Redo(),
            )
            for lane, target in self.targets.items()
        }

    def _redo(self) -> dict[str, Redo]:
        """Table -> the inserts into it a resume may repeat: the units since the
        last checkpoint (up to checkpoint_units), each inserting once on every
        lane writing the table; or, where a stateful processor writes only its
        final rows (its one lane), that one insert."""
        units = self.config.checkpoint_units
        lanes = collections.Counter(
            t.table for t in self.targets.values() if isinstance(t, ClickHouseTable)
        )
        redo: dict[str, Redo] = {}
        for table, count in lanes.items():
            if self.final_rows:
                redo[table] = Redo(1, "the final rows")
            else:
                redo[table] = Redo(
                    units * count,
                    f"checkpoint_units={units} units since the last checkpoint x {count} "
                    "lane(s) writing the table",
                )
        return redo

    # -- validation ---------------------------------------------------------

    def _final_mode(self) -> bool:
        mode = self.config.stateful_output
        if not self.stateful:
            return False
        assert isinstance(self.spec, ProcessorSpec)
        if mode == "final" and self.spec.finish is None:
            raise MergeRequired(
                f"stateful processor {self.spec.name!r} has no finish(state, keys) registered; "
                "stateful_output='final' needs one"
            )
        return mode == "final" or (mode == "auto" and self.spec.finish is not None)

    def _check(self) -> None:
        config, spec = self.config, self.spec
        if spec.input is not None and spec.input != self.source.layout:
            raise LayoutMismatch(
                f"processor {spec.name!r} reads layout {spec.input!r}, but the corpus holds "
                f"layout {self.source.layout!r}"
            )
        self.source.check(config.schema)
        if config.backend not in ("inprocess", "processes", "ray"):
            raise ReplayConfigError(
                f"unknown backend {config.backend!r}; expected inprocess, processes or ray"
            )
        if config.backend == "inprocess" and config.workers != 1:
            raise ReplayConfigError(
                f"backend 'inprocess' has one worker, got workers={config.workers}; "
                "use backend 'processes' or 'ray' for more"
            )
        if config.schedule not in ("static", "pull"):
            raise ReplayConfigError(
                f"unknown schedule {config.schedule!r}; expected static or pull"
            )
        if self.stateful and config.backend != "inprocess":
            assert isinstance(spec, ProcessorSpec)
            missing = [n for n in ("merge", "finish") if getattr(spec, n) is None]
            if missing or not self.final_rows:
                raise MergeRequired(
                    f"stateful processor {spec.name!r} on backend {config.backend!r} "
                    f"({config.workers} worker(s)) needs a registered merge and finish to combine "
                    f"the workers' partial states (missing: {', '.join(missing) or 'none'}; "
                    f"stateful_output={config.stateful_output!r}); run it on backend "
                    "'inprocess', or register them: @stateful_processor(..., merge=..., finish=...)"
                )

    def _resolve_targets(self, layouts: dict[str, str]) -> dict[str, LaneTarget]:
        unknown = sorted(set(self.config.outputs) - set(layouts))
        if unknown:
            raise ReplayConfigError(
                f"outputs name lane(s) {unknown} that processor {self.spec.name!r} does not "
                f"have; its lanes: {sorted(layouts)}"
            )
        targets: dict[str, LaneTarget] = {}
        for lane, layout in sorted(layouts.items()):
            target = self.config.outputs.get(lane)
            if target is None:
                if self.transport is None:
                    raise ReplayConfigError(
                        f"lane {lane!r} has no output target and the run has no ClickHouse; "
                        "give outputs={lane: ParquetDir(...)} or clickhouse=..."
                    )
                target = ClickHouseTable(f"replay_{layout}")
            targets[lane] = target
        return targets

    def identity(self) -> dict[str, Any]:
        """What decides the outputs: hashed; a resume must match it."""
        schema = self.config.schema
        layouts = {self.source.layout, *lanes_of(self.spec).values()}
        return {
            "source": self.source.identity(),
            "processor": self.spec.name,
            "params": dict(self.config.params),
            "lanes": describe_targets(self.targets),
            "unit_rows": self.config.unit_rows,
            "stateful_output": "final" if self.final_rows else ("units" if self.stateful else None),
            "layouts": {
                name: [[c.name, c.type, list(c.shape)] for c in schema.layout(name).columns]
                for name in sorted(layouts)
            },
        }

    def runs_dir(self) -> Path:
        if self.config.runs_dir is not None:
            return Path(self.config.runs_dir)
        for target in self.targets.values():
            if isinstance(target, ParquetDir):
                return Path(target.path).parent / "_replay_runs"
        if isinstance(self.transport, ChdbTransport):
            return self.transport.path.parent / f"{self.transport.path.name}-replay-runs"
        return Path("taproute-replay-runs")


__all__ = ["CheckedRun"]
