"""What one replay is: :class:`ReplayConfig`, the settings the driver runs.

Field-level checks live here (positive counts, targets parsed from strings);
checks that need the processor or the corpus are the driver's
(:mod:`taproute.service.replay.runner`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import attrs

from taproute.routing.schema import RecordSchema
from taproute.service.replay.backends import BackendName, Schedule
from taproute.service.replay.corpus import Corpus
from taproute.service.replay.errors import ReplayConfigError
from taproute.service.replay.lanes import LaneTarget, parse_target
from taproute.service.sinks.clickhouse.transport import Transport

StatefulOutput = Literal["auto", "units", "final"]


def _targets(value: Mapping[str, LaneTarget | str]) -> dict[str, LaneTarget]:
    return {k: parse_target(v) if isinstance(v, str) else v for k, v in value.items()}


def _positive(_: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not value > 0:  # NaN fails this comparison too
        raise ReplayConfigError(f"{attribute.name} must be > 0, got {value!r}")


@attrs.frozen(kw_only=True)
class ReplayConfig:
    """One replay: what to read, which processor, where rows go, how to run.

    - ``source``: a :class:`ClickHouseCorpus` or :class:`ParquetCorpus` (with its filters);
    - ``processor``: a registered live (stateless/stateful) or batch processor;
      ``modules`` are imported first (and in every worker) to register it;
    - ``outputs``: lane -> :class:`ClickHouseTable` / :class:`ParquetDir`
      (default: table ``replay_<layout>`` on ``clickhouse``);
    - ``clickhouse``: where ClickHouse lanes write (default: the corpus's);
    - ``on_bind``: listeners the replay's hook registry calls for every hook
      it binds (as a live program subscribes them, e.g. to map hooks to layers);
    - ``backend`` / ``workers`` / ``schedule``: ``inprocess`` (1 worker),
      ``processes`` or ``ray``; ``static`` bags or a ``pull`` queue;
    - ``stateful_output``: ``units`` writes the rows each unit returns (as live
      does; one worker carrying the state), ``final`` writes ``finish``'s rows
      of the final state once; ``auto`` is ``final`` when the processor
      registered a ``finish``;
    - checkpoints every ``checkpoint_units`` units or ``checkpoint_seconds``;
      a failing unit is tried ``retries`` more times, then recorded failed.
    """

    source: Corpus
    processor: str
    schema: RecordSchema
    outputs: Mapping[str, LaneTarget] = attrs.field(factory=dict, converter=_targets)
    clickhouse: Transport | None = None
    params: Mapping[str, Any] = attrs.field(factory=dict)
    modules: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    on_bind: tuple[Callable[[str, int], None], ...] = attrs.field(default=(), converter=tuple)
    backend: BackendName = "inprocess"
    workers: int = attrs.field(default=1, validator=_positive)
    schedule: Schedule = "static"
    unit_rows: int = attrs.field(default=4096, validator=_positive)
    checkpoint_units: int = attrs.field(default=16, validator=_positive)
    checkpoint_seconds: float = attrs.field(default=30.0, validator=_positive)
    retries: int = 2
    runs_dir: Path | None = None
    stateful_output: StatefulOutput = "auto"
    progress: bool | None = None
    #: Called with each unit id once its rows are written (tests, custom reporting).
    on_unit: Callable[[str], None] | None = None
