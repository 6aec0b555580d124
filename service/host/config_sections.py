"""The config file's small sections: ``[routing]``, ``[ingress]``,
``[shutdown]``, ``[dead_letters]`` and ``[producer]``, each a frozen value class whose field
names are the file's keys (bounds registered with the file's rules)."""

from __future__ import annotations

from typing import Literal

import attrs

from taproute.routing.causal import CAUSAL_LIMITS, CausalLimits
from taproute.routing.checks import Limit
from taproute.routing.limits import QUEUE_BYTES, QUEUE_RECORDS, SHUTDOWN_GRACE_S
from taproute.service.host.config_rules import add_limits
from taproute.service.ops.dead_letters import BUSY_TIMEOUT_S, LOCK_BOUND_S


@attrs.frozen(kw_only=True)
class RoutingOptions:
    """Where records no route takes go: a destination, or dropped (counted);
    whether route chains may form cycles, and the causal limits every chain
    lives under (``[routing.causal_limits]``: ``CausalLimits``' fields)."""

    default_destination: str | None = None
    unmatched: Literal["default", "drop"] = "default"
    allow_cycles: bool = False
    causal_limits: CausalLimits = attrs.Factory(CausalLimits)


@attrs.frozen(kw_only=True)
class IngressOptions:
    """Bounds of the runtime's ingress and what a full ingress does to producers.

    ``max_block``: seconds a capture hook may wait for ingress room before its
    records are shed and counted (``create_record_runtime(max_block=...)``;
    also the default ``spool_block_timeout``); unset, a full ingress blocks
    the model until there is room.
    """

    capacity_records: int = QUEUE_RECORDS
    capacity_bytes: int = QUEUE_BYTES
    when_full: Literal["block", "reject"] = "block"
    max_block: float | None = None


#: Bounds of :class:`ShutdownOptions`' numbers (its own validator and files use them).
SHUTDOWN_LIMITS: dict[str, Limit] = {"grace": Limit(0, 3600)}


@attrs.frozen(kw_only=True)
class ShutdownOptions:
    """How long the service's close (``stop()``, leaving its ``with`` block,
    ``taproute run`` ending on SIGTERM or Ctrl-C) may take.

    ``grace``: seconds to drain, flush and close; past it the destinations
    still busy are cut off, what they had queued is given up and counted,
    and close raises ``ShutdownAbandoned`` naming them
    (``create_record_runtime(shutdown_grace=...)``; 30 by default, as
    Kubernetes' termination grace: keep it below the pod's).
    """

    grace: float = attrs.field(
        default=SHUTDOWN_GRACE_S,
        validator=SHUTDOWN_LIMITS["grace"].check(float, owner=lambda _: "ShutdownOptions"),
    )


@attrs.frozen(kw_only=True)
class DeadLetterOptions:
    """Where given-up records are kept (default: beside the first chDB destination).

    ``busy_timeout``: seconds one write waits for a lock another holder keeps
    on the file (an operator's ``sqlite3`` session); ``lock_bound``: seconds a
    write keeps trying a locked file, its records waiting in their route,
    before the failure is latched (``DeadLetterStore(busy_timeout=,
    lock_bound=)``).
    """

    path: str | None = None
    busy_timeout: float = BUSY_TIMEOUT_S
    lock_bound: float = LOCK_BOUND_S


@attrs.frozen(kw_only=True)
class ProducerHook:
    """A hook `taproute run` feeds with random payloads of its layout."""

    name: str
    layout: str
    batch: int = 64
    elements: int = 256  # for a variable-length tail


@attrs.frozen(kw_only=True)
class ProducerConfig:
    """What `taproute run` generates."""

    hooks: tuple[ProducerHook, ...] = ()


add_limits(CausalLimits, CAUSAL_LIMITS)
add_limits(
    IngressOptions,
    {
        "capacity_records": Limit(1, 2**32),
        "capacity_bytes": Limit(1, 2**44),
        "max_block": Limit(0, 3600),
    },
)
add_limits(ShutdownOptions, SHUTDOWN_LIMITS)
add_limits(DeadLetterOptions, {"busy_timeout": Limit(0, 3600), "lock_bound": Limit(0, 86400)})
add_limits(ProducerHook, {"batch": Limit(1, 2**20), "elements": Limit(0, 2**28)})
