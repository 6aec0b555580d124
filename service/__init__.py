"""How taproute is hosted and reached: the runtime and the destinations.

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
    SlotSpec,
    stateful_processor,
    stateless_processor,
)
from taproute.service.capture import CaptureSink
from taproute.service.clickhouse import ClickHouseSink
from taproute.service.dead_letters import DeadLetterStore
from taproute.service.http import HttpConfig
from taproute.service.runtime import RecordRuntime, create_record_runtime

__all__ = [
    "DESCRIPTOR_DTYPE",
    "CaptureSink",
    "ClickHouseSink",
    "Column",
    "DeadLetterStore",
    "Failed",
    "FailurePolicy",
    "HttpConfig",
    "InvalidInput",
    "Layout",
    "RecordBatch",
    "RecordRuntime",
    "RecordSchema",
    "RecordSink",
    "Records",
    "Route",
    "RouteMode",
    "RouterSnapshot",
    "RoutingConfig",
    "RoutingSink",
    "RowBatch",
    "SlotSpec",
    "create_record_runtime",
    "make_descriptors",
    "open_routing_sink",
    "stateful_processor",
    "stateless_processor",
]
