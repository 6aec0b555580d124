"""Route configuration: frozen values, checked when built."""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable

import attrs
import numpy as np
import numpy.typing as npt

from taproute.routing.errors import ConfigError, DuplicateRouteName
from taproute.routing.failures import FailurePolicy


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
    return (value,) if isinstance(value, str) else tuple(value)


def _positive(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ConfigError(f"route {attribute.name} must be a positive int, got {value!r}")


@attrs.frozen
class Route:
    """One route: which outputs, how they are processed, and where results go.

    ``outputs`` are hook names or glob patterns (``layers.*.attn.q``) matched
    against bound hook names.  ``capacity`` and ``capacity_bytes`` bound each
    of the route's mailboxes; when full, the record worker waits.
    """

    name: str = attrs.field()
    outputs: tuple[str, ...] = attrs.field(converter=_to_outputs)
    destination: str = attrs.field()
    mode: RouteMode = attrs.field(default=RouteMode.FORWARD, converter=RouteMode)
    processor: str | None = None
    capacity: int = attrs.field(default=65_536, validator=_positive)
    capacity_bytes: int = attrs.field(default=256 * 2**20, validator=_positive)
    workers: int = attrs.field(default=1, validator=_positive)
    failure_policy: FailurePolicy = attrs.field(factory=FailurePolicy)
    #: ``predicate(descriptors) -> bool array`` (True: the route takes the
    #: record), or ``(bool array, reason)`` naming why it declined the rest.
    predicate: Predicate | None = attrs.field(default=None, eq=False)

    @name.validator
    def _check_name(self, _: object, value: str) -> None:
        if not isinstance(value, str) or not value:
            raise ConfigError(f"route name must be a non-empty string, got {value!r}")

    @outputs.validator
    def _check_outputs(self, _: object, value: tuple[str, ...]) -> None:
        if not value or not all(isinstance(v, str) and v for v in value):
            raise ConfigError(
                f"route {self.name!r}: outputs must be non-empty names, got {value!r}"
            )

    @destination.validator
    def _check_destination(self, _: object, value: str) -> None:
        if not isinstance(value, str) or not value:
            raise ConfigError(f"route {self.name!r}: destination must be a name, got {value!r}")

    def __attrs_post_init__(self) -> None:
        if self.mode is RouteMode.FORWARD and self.processor is not None:
            raise ConfigError(
                f"route {self.name!r}: a forward route takes no processor "
                f"(got {self.processor!r}); use mode='stateless' or 'stateful'"
            )
        if self.mode is not RouteMode.FORWARD and not self.processor:
            raise ConfigError(f"route {self.name!r}: mode {self.mode.value!r} needs a processor")


def _to_routes(value: Iterable[Route]) -> tuple[Route, ...]:
    return tuple(value)


@attrs.frozen
class RoutingConfig:
    """The routes of one routing sink, in order (route order is fan-out order)."""

    routes: tuple[Route, ...] = attrs.field(converter=_to_routes)

    def __attrs_post_init__(self) -> None:
        seen: set[str] = set()
        for route in self.routes:
            if not isinstance(route, Route):
                raise ConfigError(f"RoutingConfig takes Route objects, got {route!r}")
            if route.name in seen:
                raise DuplicateRouteName(f"duplicate route name {route.name!r}")
            seen.add(route.name)
