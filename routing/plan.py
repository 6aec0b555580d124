"""The route plan: a RoutingConfig checked against the schema, the processor
registry and the destinations, with each route's output patterns compiled.

Pure: building a plan runs nothing.  The actors layer turns a plan into a
native route table and running actors.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable
from fnmatch import translate
from typing import Literal

import attrs

from taproute.routing.chains import Chains, resolve_chains
from taproute.routing.errors import (
    ConfigError,
    GlobMatchesNothing,
    UnknownDestination,
    at,
    raise_collected,
)
from taproute.routing.layout import Layout
from taproute.routing.narrowing import Narrowing
from taproute.routing.processors import REGISTRY, ProcessorKind, ProcessorRegistry, ProcessorSpec
from taproute.routing.routes import DERIVED_PREFIX, Route, RouteMode, RoutingConfig
from taproute.routing.schema import RecordSchema

Unmatched = Literal["default", "drop"]


@attrs.frozen
class PlannedRoute:
    """One checked route and what it resolved to."""

    index: int
    route: Route
    processor: ProcessorSpec | None
    input_layout: Layout | None
    output_layout: Layout | None
    pattern: re.Pattern[str] = attrs.field(repr=False)
    #: Names of the routes whose output this route takes (chains).
    derived_from: frozenset[str] = frozenset()
    #: A forward route's narrowing (None: its records go on as they are).
    narrowing: Narrowing | None = None

    @property
    def name(self) -> str:
        """The route's name."""
        return self.route.name

    def matches(self, hook_name: str) -> bool:
        """True when ``hook_name`` matches one of the route's outputs.

        A derived hook (``route:<name>``) matches only the routes chained to
        that route's output; hook patterns never match derived hooks.
        """
        if hook_name.startswith(DERIVED_PREFIX):
            return hook_name[len(DERIVED_PREFIX) :] in self.derived_from
        return self.pattern.fullmatch(hook_name) is not None

    @property
    def payload_problem(self) -> str | None:
        """Why this route's rows cannot be carried as records (None: they can)."""
        layout = self.output_layout
        if layout is None or layout.is_fixed:
            return None
        variable = [c.name for c in layout.columns if c.is_variable]
        return (
            f"its output layout {layout.name!r} has variable-length column(s) "
            f"{', '.join(variable)}: only fixed-size rows can be routed again"
        )


class RoutePlan:
    """Checked routes plus the hook-name matching rules.

    Checks every route before raising: one problem raises its
    :class:`~taproute.routing.errors.ConfigError` subclass, several raise
    :class:`~taproute.routing.errors.PlanErrors` listing each; every error's
    ``where`` is its key path (``routes[2]``, ``default_destination``), its
    message names the route and the unknown processor, destination or layout.  Warns
    (:class:`GlobMatchesNothing`) for outputs no bound hook matches, when
    hooks are already bound; hooks bound later still resolve.
    """

    def __init__(
        self,
        config: RoutingConfig,
        schema: RecordSchema,
        *,
        destinations: Iterable[str],
        default_destination: str | None = None,
        unmatched: Unmatched = "default",
        registry: ProcessorRegistry = REGISTRY,
        bound_names: Iterable[str] = (),
    ) -> None:
        known = set(destinations)
        errors: list[ConfigError] = []
        if unmatched not in ("default", "drop"):
            errors.append(
                at(
                    ConfigError(f"unmatched must be 'default' or 'drop', got {unmatched!r}"),
                    "unmatched",
                )
            )
        elif unmatched == "default":
            if default_destination is None:
                errors.append(
                    at(
                        ConfigError(
                            "no default_destination for unmatched records; name one, or pass "
                            "unmatched='drop' to drop (and count) records no route takes"
                        ),
                        "default_destination",
                    )
                )
            elif default_destination not in known:
                errors.append(
                    at(
                        UnknownDestination(
                            f"default_destination {default_destination!r} is not among the "
                            f"destinations {sorted(known)}"
                        ),
                        "default_destination",
                    )
                )
        self.schema = schema
        self.unmatched: Unmatched = unmatched
        self.default_destination = default_destination if unmatched == "default" else None
        routes: list[PlannedRoute] = []
        for i, route in enumerate(config.routes):
            # A route's destination and its processor are checked apart, so a
            # route wrong in both gets both reported.
            unknown = route.destination not in known
            if unknown:
                errors.append(
                    at(
                        UnknownDestination(
                            f"route {route.name!r}: unknown destination "
                            f"{route.destination!r}; given {sorted(known)}"
                        ),
                        f"routes[{i}]",
                    )
                )
            try:
                planned = _plan_route(i, route, schema, registry)
            except ConfigError as exc:
                errors.append(at(exc, f"routes[{i}]"))
                continue
            if not unknown:
                routes.append(planned)
        chains: Chains | None = None
        if len(routes) == len(config.routes):
            chains, chain_errors = resolve_chains(
                config,
                [None if p.output_layout is None else p.output_layout.name for p in routes],
                [None if p.input_layout is None else p.input_layout.name for p in routes],
                [p.payload_problem for p in routes],
            )
            errors.extend(chain_errors)
        raise_collected(errors)
        assert chains is not None
        #: Which routes take which route's output again.
        self.chains = chains
        self.allow_cycles = config.allow_cycles
        self.causal_limits = config.causal_limits
        self.routes: tuple[PlannedRoute, ...] = tuple(
            attrs.evolve(p, derived_from=chains.sources[p.index]) if chains.sources[p.index] else p
            for p in routes
        )
        bound = [name for name in bound_names if not name.startswith(DERIVED_PREFIX)]
        # With no hook bound yet every pattern "matches nothing"; the check only
        # means something once the producer has bound its hooks.
        for planned in self.routes if bound else ():
            for output in planned.route.outputs:
                if output.startswith(DERIVED_PREFIX):
                    continue  # a chain: checked when resolved
                regex = re.compile(translate(output))
                if not any(regex.fullmatch(name) for name in bound):
                    warnings.warn(
                        f"route {planned.name!r}: output {output!r} matches no bound hook yet "
                        f"({len(bound)} bound); hooks bound later will still match",
                        GlobMatchesNothing,
                        stacklevel=3,
                    )

    def routes_for(self, hook_name: str) -> tuple[int, ...]:
        """Indices of the routes ``hook_name`` feeds, in route order."""
        return tuple(p.index for p in self.routes if p.matches(hook_name))

    @property
    def destinations_used(self) -> list[str]:
        """Destination names the routes and the default use, in first-use order."""
        names = [p.route.destination for p in self.routes]
        if self.default_destination is not None:
            names.append(self.default_destination)
        return list(dict.fromkeys(names))


def _plan_route(
    index: int, route: Route, schema: RecordSchema, registry: ProcessorRegistry
) -> PlannedRoute:
    where = f"route {route.name!r}"
    hooks = [o for o in route.outputs if not o.startswith(DERIVED_PREFIX)]
    # No hook output (the route only takes other routes' output): match no hook.
    pattern = re.compile("|".join(f"(?:{translate(o)})" for o in hooks) or "(?!)")
    if route.mode is RouteMode.FORWARD:
        narrowing = Narrowing.build(route.narrow, schema, where=where) if route.narrow else None
        return PlannedRoute(index, route, None, None, None, pattern, narrowing=narrowing)
    assert route.processor is not None  # Route checks this
    try:
        spec = registry.get(route.processor)
    except ConfigError as exc:
        raise type(exc)(f"{where}: {exc}") from None
    expected = (
        ProcessorKind.STATEFUL if route.mode is RouteMode.STATEFUL else ProcessorKind.STATELESS
    )
    if spec.kind is not expected:
        raise ConfigError(
            f"{where}: mode {route.mode.value!r} needs a {expected.value} processor, "
            f"but {spec.name!r} is {spec.kind.value}"
        )
    try:
        input_layout = None if spec.input is None else schema.layout(spec.input)
        output_layout = schema.layout(spec.output)
    except ConfigError as exc:
        raise type(exc)(f"{where}, processor {spec.name!r}: {exc}") from None
    if input_layout is not None:
        input_layout.check_payload_layout()
    if spec.kind is ProcessorKind.STATEFUL:
        assert spec.key_range is not None
        if route.workers > spec.key_range:
            raise ConfigError(
                f"{where}: {route.workers} owners for key_range {spec.key_range}; "
                "at most one owner per key"
            )
    return PlannedRoute(index, route, spec, input_layout, output_layout, pattern)
