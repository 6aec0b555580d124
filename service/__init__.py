"""taproute's public face: everything an embedding program imports.

The service itself is shelved by role (see the README's layout table):
``host/`` (the runtime thread, ingress, config files, HTTP, the command),
``sinks/`` (capture and ClickHouse destinations), ``ops/`` (dead letters and
operator controls), ``capture/`` (PyTorch hooks; needs torch, so it is imported
as :mod:`taproute.service.capture`, not from here) and ``demo/``.

The one import an embedding program needs::

    from taproute.service import (
        CaptureSink, Layout, RecordSchema, Route, RoutingConfig, RoutingSink,
        create_record_runtime, stateless_processor,
    )
"""

from taproute.actors import RouterSnapshot, RoutingSink, open_routing_sink
from taproute.native import DESCRIPTOR_DTYPE, make_descriptors
from taproute.routing import (
    Column,
    Failed,
    FailurePolicy,
    IngressFull,
    InvalidInput,
    Layout,
    RecordBatch,
    Records,
    RecordSchema,
    RecordSink,
    Route,
    RouteMode,
    RoutingConfig,
    RowBatch,
    Sample,
    SampleContext,
    SampleTraces,
    SlotSpec,
    stateful_processor,
    stateless_processor,
)
from taproute.routing.causal import (
    CausalLimits,
    CausalRefusal,
    CausalSnapshot,
)
from taproute.routing.chains import ChainCycle, ChainError
from taproute.routing.errors import (
    ConfigError,
    FlushCutOff,
    KeyNotHeld,
    PayloadDtypeMismatch,
    PayloadSizeMismatch,
    PlanErrors,
    RerouteRefused,
    RoutingFailure,
    ShutdownAbandoned,
    SinkClosed,
    UnboundOutputId,
)
from taproute.routing.flush_report import FlushReport, RouteAccount
from taproute.routing.parking import ParkStore
from taproute.routing.refusals import Refusal, UnmatchedSample
from taproute.routing.root_ledger import RootLedger
from taproute.service.host.config import BuiltService, ConfigFileError, load_config
from taproute.service.host.counters import IngressCounters, ServiceSnapshot
from taproute.service.host.http import HttpConfig
from taproute.service.host.metrics import SnapshotCollector
from taproute.service.host.reload import ConfigReloader
from taproute.service.host.runtime import RecordRuntime
from taproute.service.host.service import RecordService, create_record_runtime
from taproute.service.ops.dead_letters import (
    DeadLetterNotFound,
    DeadLetterStore,
    DeadLetterStoreError,
)
from taproute.service.ops.parking import ParkedRecordStore
from taproute.service.replay import (
    ClickHouseCorpus,
    ClickHouseTable,
    Filters,
    ParquetCorpus,
    ParquetDir,
    ProcessResult,
    ReplayConfig,
    ReplayReport,
    RunInUse,
    UnitsFailed,
    batch_processor,
    run_replay,
)
from taproute.service.sinks.capture import CaptureSink
from taproute.service.sinks.clickhouse import (
    Batching,
    ClickHouseSink,
    InsertAbandoned,
    MissingTable,
    NoDeduplication,
    Retry,
    SchemaMismatch,
    ServerUnreachable,
)
from taproute.service.sinks.clickhouse.readback import (
    Capture,
    ReadBackError,
    load_captures,
    load_rows,
)
from taproute.service.sinks.spool import Spool, SpoolConfig, SpoolFull
from taproute.service.sinks.spool.log import SpoolLocked
from taproute.service.sinks.spool.spooling import Backoff, SpoolingSink
from taproute.service.sinks.writer import (
    DirectoryInUse,
    SharedBufferPool,
    WriterCrashed,
    WriterProcessSink,
    WriterStartError,
)

__all__ = [
    "DirectoryInUse",
    "SharedBufferPool",
    "WriterCrashed",
    "WriterProcessSink",
    "WriterStartError",
    "CausalLimits",
    "CausalRefusal",
    "CausalSnapshot",
    "ChainCycle",
    "ChainError",
    "Refusal",
    "RootLedger",
    "UnmatchedSample",
    "Backoff",
    "Spool",
    "SpoolConfig",
    "SpoolFull",
    "SpoolingSink",
    "run_replay",
    "batch_processor",
    "UnitsFailed",
    "RunInUse",
    "ReplayReport",
    "ReplayConfig",
    "ProcessResult",
    "ParquetDir",
    "ParquetCorpus",
    "Filters",
    "ClickHouseTable",
    "ClickHouseCorpus",
    "Capture",
    "ReadBackError",
    "load_captures",
    "load_rows",
    "DESCRIPTOR_DTYPE",
    "Batching",
    "CaptureSink",
    "ClickHouseSink",
    "Column",
    "DeadLetterStore",
    "FlushReport",
    "ParkStore",
    "ParkedRecordStore",
    "RouteAccount",
    "Failed",
    "FailurePolicy",
    "HttpConfig",
    "IngressFull",
    "IngressCounters",
    "InvalidInput",
    "Layout",
    "MissingTable",
    "NoDeduplication",
    "RecordBatch",
    "RecordRuntime",
    "RecordSchema",
    "RecordService",
    "RecordSink",
    "Retry",
    "Records",
    "Route",
    "RouteMode",
    "RouterSnapshot",
    "RoutingConfig",
    "RoutingSink",
    "RowBatch",
    "SchemaMismatch",
    "ServerUnreachable",
    "ServiceSnapshot",
    "SnapshotCollector",
    "Sample",
    "SampleContext",
    "SampleTraces",
    "ConfigReloader",
    "SlotSpec",
    "create_record_runtime",
    "make_descriptors",
    "open_routing_sink",
    "stateful_processor",
    "stateless_processor",
]
__all__ += [
    "BuiltService",
    "ConfigError",
    "ConfigFileError",
    "DeadLetterNotFound",
    "DeadLetterStoreError",
    "PayloadDtypeMismatch",
    "PayloadSizeMismatch",
    "PlanErrors",
    "RerouteRefused",
    "RoutingFailure",
    "ShutdownAbandoned",
    "FlushCutOff",
    "InsertAbandoned",
    "KeyNotHeld",
    "SinkClosed",
    "SpoolLocked",
    "UnboundOutputId",
    "load_config",
]
