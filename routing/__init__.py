"""What goes where: records, layouts, routes and processors.

Pure configuration and values; no Trio, no I/O.  Import from here::

    from taproute.routing import Layout, RecordSchema, Route, RoutingConfig
"""

from taproute.routing.batch import Batch, RecordBatch, Retained, RowBatch
from taproute.routing.errors import (
    ConfigError,
    DuplicateProcessor,
    DuplicateRouteName,
    FlushCutOff,
    GlobMatchesNothing,
    HookBindingError,
    IngressFull,
    KeyNotHeld,
    KeyOutOfRange,
    KeyTerminal,
    LayoutError,
    OutputLayoutMismatch,
    PayloadSizeMismatch,
    PlanErrors,
    RecordError,
    RoutingFailure,
    ShutdownAbandoned,
    SinkClosed,
    TaprouteError,
    UnboundOutputId,
    UnknownDestination,
    UnknownLayout,
    UnknownProcessor,
)
from taproute.routing.failures import (
    PANIC_TYPES,
    Failed,
    FailureCode,
    FailureHandler,
    FailurePolicy,
    InvalidInput,
    ProcessorFailed,
    RecordFailure,
    classify,
    log_failure,
)
from taproute.routing.hooks import HookRegistry
from taproute.routing.latch import FailureLatch
from taproute.routing.layout import Column, Layout
from taproute.routing.plan import PlannedRoute, RoutePlan
from taproute.routing.processors import (
    REGISTRY,
    ProcessorKind,
    ProcessorRegistry,
    ProcessorSpec,
    SlotSpec,
    request_key,
    stateful_processor,
    stateless_processor,
)
from taproute.routing.records import Records
from taproute.routing.routes import Route, RouteMode, RoutingConfig
from taproute.routing.samples import (
    OffersSamples,
    Sample,
    SampleContext,
    SampleTrace,
    SampleTraces,
    route_samples,
)
from taproute.routing.schema import RecordSchema, SizeRule
from taproute.routing.sink import RecordSink
from taproute.routing.validation import check_batch, check_rows

__all__ = [
    "REGISTRY",
    "OffersSamples",
    "Sample",
    "SampleContext",
    "route_samples",
    "SampleTrace",
    "SampleTraces",
    "Batch",
    "Column",
    "ConfigError",
    "PlanErrors",
    "DuplicateProcessor",
    "DuplicateRouteName",
    "Failed",
    "FailureCode",
    "FailureHandler",
    "FailureLatch",
    "FailurePolicy",
    "GlobMatchesNothing",
    "HookBindingError",
    "HookRegistry",
    "IngressFull",
    "InvalidInput",
    "KeyNotHeld",
    "KeyOutOfRange",
    "KeyTerminal",
    "Layout",
    "LayoutError",
    "OutputLayoutMismatch",
    "PayloadSizeMismatch",
    "PlannedRoute",
    "ProcessorFailed",
    "ProcessorKind",
    "ProcessorRegistry",
    "ProcessorSpec",
    "RecordBatch",
    "RecordError",
    "RecordFailure",
    "RecordSchema",
    "RecordSink",
    "Records",
    "Retained",
    "Route",
    "RouteMode",
    "RoutePlan",
    "RoutingConfig",
    "RoutingFailure",
    "RowBatch",
    "ShutdownAbandoned",
    "FlushCutOff",
    "SinkClosed",
    "SizeRule",
    "SlotSpec",
    "TaprouteError",
    "UnboundOutputId",
    "UnknownDestination",
    "UnknownLayout",
    "UnknownProcessor",
    "check_batch",
    "check_rows",
    "log_failure",
    "PANIC_TYPES",
    "classify",
    "request_key",
    "stateful_processor",
    "stateless_processor",
]
