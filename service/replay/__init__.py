"""Batch replay: the registered processors run over stored corpora.

Recompute a statistic over activations captured last week, or backfill a
table after a processor bug was fixed, with the same processors the live
routes run: a corpus (taproute's raw ClickHouse tables, or Parquet files) is
walked in work units with stable ids; each unit's records reach the processor
through the same ``Records`` API, its rows are validated against the output
layout and written on lanes (tables or Parquet directories) exactly once, and
a ledger beside the outputs records what is done, so a crashed run resumes.
Backends: ``inprocess``, ``processes``, ``ray`` (``pip install "taproute[ray]"``).
"""

from taproute.service.replay.config import ReplayConfig
from taproute.service.replay.contract import (
    BATCH_REGISTRY,
    BatchProcessorSpec,
    ProcessorBatch,
    ProcessResult,
    RunContext,
    batch_processor,
)
from taproute.service.replay.corpus import ClickHouseCorpus, Corpus, ParquetCorpus
from taproute.service.replay.errors import (
    ConfigChanged,
    LayoutMismatch,
    MergeRequired,
    MissingSource,
    NotExactlyOnce,
    ReplayConfigError,
    ReplayError,
    RunInUse,
    UnitsFailed,
    UnknownRun,
    WorkerLost,
)
from taproute.service.replay.lanes import ClickHouseTable, LaneTarget, ParquetDir
from taproute.service.replay.report import ReplayReport
from taproute.service.replay.runner import config_digest, run_replay
from taproute.service.replay.units import Filters, WorkUnit

__all__ = [
    "BATCH_REGISTRY",
    "BatchProcessorSpec",
    "ClickHouseCorpus",
    "ClickHouseTable",
    "ConfigChanged",
    "Corpus",
    "Filters",
    "LaneTarget",
    "LayoutMismatch",
    "MergeRequired",
    "MissingSource",
    "NotExactlyOnce",
    "ParquetCorpus",
    "ParquetDir",
    "ProcessResult",
    "ProcessorBatch",
    "ReplayConfig",
    "ReplayConfigError",
    "ReplayError",
    "ReplayReport",
    "RunContext",
    "UnitsFailed",
    "RunInUse",
    "UnknownRun",
    "WorkUnit",
    "WorkerLost",
    "batch_processor",
    "config_digest",
    "run_replay",
]
