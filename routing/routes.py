"""Route configuration: frozen values, checked when built."""

from __future__ import annotations

import enum
import types
from collections.abc import Callable, Iterable, Mapping

import attrs
import numpy as np
import numpy.typing as npt
from attrs import validators as v

from taproute.routing.causal import CausalLimits
from taproute.routing.checks import NAME, Limit, Validator, config_check
from taproute.routing.errors import ConfigError, DuplicateRouteName
from taproute.routing.failures import FailurePolicy
from taproute.routing.limits import QUEUE_BYTES, QUEUE_RECORDS


class RouteMode(enum.StrEnum):
    """How a route runs.

    - ``forward``: the batch goes to the destination unchanged, inline on the
      record worker, without a copy.
    - ``stateless``: a pool of ``workers`` actors runs the processor concurrently.
    - ``stateful``: ``workers`` owner actors each hold a key range of the route's
      K x N state; records of one key are processed in arrival order.
    """

    FORWARD = "forward"
    STATELESS = "stateless"
    STATEFUL = "stateful"


Predicate = Callable[[npt.NDArray[np.void]], "npt.ArrayLike | tuple[npt.ArrayLike, str]"]


def _to_outputs(value: str | Iterable[str]) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, Iterable):
        raise ConfigError(
            f"route outputs: expected a name or an iterable of names, found {value!r}"
        )
    return tuple(value)


def _to_mode(value: RouteMode | str) -> RouteMode:
    try:
        return RouteMode(value)
    except ValueError:
        expected = ", ".join(repr(mode.value) for mode in RouteMode)
        raise ConfigError(f"route mode: expected one of {expected}, found {value!r}") from None


def _to_narrow(value: Mapping[str, str]) -> Mapping[str, str]:
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"narrow must map source layouts to their BFloat16 twins, got {type(value).__name__}"
        )
    for source, target in value.items():
        if not isinstance(source, str) or not isinstance(target, str) or not source or not target:
            raise ConfigError(
                f"narrow maps layout names to layout names, got {source!r}: {target!r}"
            )
    return types.MappingProxyType(dict(value))


def _route(route: Route) -> str:
    name = route.name  # validators run once every field is set; it may be the invalid one
    return f"route {name!r}" if isinstance(name, str) and name else "route"


#: Bounds of a route's numbers: its own validators and config files use these.
ROUTE_LIMITS: dict[str, Limit] = {
    "capacity": Limit(1, 2**32),
    "capacity_bytes": Limit(1, 2**44),
    "workers": Limit(1, 1024),
}


def _bounded(field: str) -> Validator:
    return ROUTE_LIMITS[field].check(int, _route)


_name = config_check(*NAME, must="a non-empty string", owner=_route)
_outputs = config_check(
    v.min_len(1), v.deep_iterable(v.and_(*NAME)), must="non-empty names", owner=_route
)
_then = config_check(v.deep_iterable(v.and_(*NAME)), must="route names", owner=_route)
_processor = config_check(
    v.optional(v.and_(*NAME)), must="a registered processor's name (a str)", owner=_route
)
_policy = config_check(
    v.instance_of(FailurePolicy),
    must="a FailurePolicy (FailurePolicy(deadline=2.0, ...))",
    owner=_route,
)
_predicate = config_check(
    v.optional(v.is_callable()),
    must="callable as predicate(descriptors) -> bool array",
    owner=_route,
)

#: Outputs starting with this name another route's output (``route:norms``,
#: or a glob over route names: ``route:norm*``) instead of hooks; derived
#: records carry the hook name ``route:<emitting route>``.
DERIVED_PREFIX = "route:"


@attrs.frozen
class Route:
    """One route: which outputs, how they are processed, and where results go.

    ``outputs`` are hook names or glob patterns (``layers.*.attn.q``) matched
    against bound hook names.  ``capacity`` and ``capacity_bytes`` bound each
    of the route's mailboxes; when full, the record worker waits.
    """

    name: str = attrs.field(validator=_name)
    outputs: tuple[str, ...] = attrs.field(converter=_to_outputs, validator=_outputs)
    destination: str = attrs.field(validator=_name)
    # What a route *is* (name, outputs, destination) may be positional; how it
    # runs is always spelled out.
    mode: RouteMode = attrs.field(default=RouteMode.FORWARD, converter=_to_mode, kw_only=True)
    processor: str | None = attrs.field(default=None, validator=_processor, kw_only=True)
    capacity: int = attrs.field(default=QUEUE_RECORDS, validator=_bounded("capacity"), kw_only=True)
    capacity_bytes: int = attrs.field(
        default=QUEUE_BYTES, validator=_bounded("capacity_bytes"), kw_only=True
    )
    workers: int = attrs.field(default=1, validator=_bounded("workers"), kw_only=True)
    failure_policy: FailurePolicy = attrs.field(
        factory=FailurePolicy, validator=_policy, kw_only=True
    )
    #: ``predicate(descriptors) -> bool array`` (True: the route takes the
    #: record), or ``(bool array, reason)`` naming why it declined the rest.
    predicate: Predicate | None = attrs.field(
        default=None, eq=False, validator=_predicate, kw_only=True
    )
    #: Routes that take this route's output again (its rows, or a forward
    #: route's records), as derived records; the same as naming
    #: ``"route:<this route>"`` in their ``outputs``.
    then: tuple[str, ...] = attrs.field(
        default=(), converter=_to_outputs, validator=_then, kw_only=True
    )
    #: Forward routes: Float32 layouts whose records the destination gets
    #: rounded to BFloat16, as ``{source layout: its BFloat16 twin}``
    #: (see :mod:`taproute.routing.narrowing`).
    narrow: Mapping[str, str] = attrs.field(
        factory=dict, converter=_to_narrow, hash=False, kw_only=True
    )

    def __attrs_post_init__(self) -> None:
        if self.narrow and self.mode is not RouteMode.FORWARD:
            raise ConfigError(
                f"route {self.name!r}: narrow applies to the raw records a forward route "
                f"hands on, not to a {self.mode.value} route (its processor's output layout "
                "decides its types)"
            )
        if self.mode is RouteMode.FORWARD and self.processor is not None:
            raise ConfigError(
                f"route {self.name!r}: a forward route takes no processor "
                f"(got {self.processor!r}); use mode='stateless' or 'stateful'"
            )
        if self.mode is not RouteMode.FORWARD and not self.processor:
            raise ConfigError(f"route {self.name!r}: mode {self.mode.value!r} needs a processor")


def _to_routes(value: Iterable[Route]) -> tuple[Route, ...]:
    if isinstance(value, Route) or not isinstance(value, Iterable):
        raise ConfigError(
            "RoutingConfig takes a list of routes (RoutingConfig([Route(...), ...])), "
            f"found {type(value).__name__}"
        )
    return tuple(value)


def _config_owner(_instance: object) -> str:
    return "RoutingConfig"


@attrs.frozen
class RoutingConfig:
    """The routes of one routing sink, in order (route order is fan-out order).

    Routes may chain (``then=``, or ``outputs=["route:<name>"]``); a chain
    that comes back to a route it left is refused when the sink is built
    unless ``allow_cycles``; every chain lives under ``causal_limits``.
    """

    routes: tuple[Route, ...] = attrs.field(converter=_to_routes)
    allow_cycles: bool = attrs.field(
        default=False,
        validator=config_check(v.instance_of(bool), must="True or False", owner=_config_owner),
        kw_only=True,
    )
    causal_limits: CausalLimits = attrs.field(
        factory=CausalLimits,
        validator=config_check(
            v.instance_of(CausalLimits),
            must="a CausalLimits (CausalLimits(max_depth=32, ...))",
            owner=_config_owner,
        ),
        kw_only=True,
    )

    def __attrs_post_init__(self) -> None:
        seen: set[str] = set()
        for route in self.routes:
            if not isinstance(route, Route):
                raise ConfigError(f"RoutingConfig takes Route objects, got {route!r}")
            if route.name in seen:
                raise DuplicateRouteName(f"duplicate route name {route.name!r}")
            seen.add(route.name)
