"""Route chains: which routes take which route's output again, resolved at build.

A route's output is routed again when another route names it —
``Route(..., then=("summary",))`` on the emitting route, or
``outputs=["route:norms"]`` (a glob over route names after the prefix) on
the taking one.  Both spellings resolve to one graph when the plan is built:

- every name must be a route of the configuration (a typo is an error, not
  a chain that silently never fires);
- the emitting route's output must be a payload layout (fixed columns, so
  its rows are records as they are: no copy), and a taking processor must
  read that layout;
- a cycle (a route whose output comes back to it, directly or through
  others) is refused, naming the routes in it, unless the configuration
  allows cycles; even then every chain stays under the causal limits
  (:mod:`taproute.routing.causal`).

Pure: no Trio, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from fnmatch import fnmatchcase

import attrs

from taproute.routing.errors import ConfigError, at
from taproute.routing.routes import DERIVED_PREFIX, RouteMode, RoutingConfig


class ChainCycle(ConfigError):
    """Routes chain back to themselves and the configuration does not allow cycles."""


class ChainError(ConfigError):
    """A chain names no route, or joins routes whose layouts do not fit."""


@attrs.frozen
class Chains:
    """The resolved chain graph.

    ``targets[i]``: indices of the routes that take route ``i``'s output, in
    route order.  ``cyclic``: the edges ``(i, j)`` inside a cycle (sending
    along them never waits for room, or a cycle could wait on itself; the
    causal limits bound what they carry).  ``sources[j]``: names of the routes
    whose output route ``j`` takes.
    """

    targets: tuple[tuple[int, ...], ...]
    sources: tuple[frozenset[str], ...]
    cyclic: frozenset[tuple[int, int]]
    cycles: tuple[tuple[str, ...], ...]

    @property
    def any(self) -> bool:
        """True when some route's output is routed again."""
        return any(self.targets)


def derived_hook(route: str) -> str:
    """The hook name records derived from ``route``'s output carry."""
    return DERIVED_PREFIX + route


def resolve_chains(
    config: RoutingConfig,
    output_layouts: Sequence[str | None],
    input_layouts: Sequence[str | None],
    payload_problems: Sequence[str | None],
) -> tuple[Chains, list[ConfigError]]:
    """The chain graph of ``config``'s routes, and every problem found.

    Per route ``i``: ``output_layouts[i]`` is the layout of its rows (None for
    a forward route: its records keep theirs), ``input_layouts[i]`` what its
    processor reads (None: any), ``payload_problems[i]`` why its output
    layout cannot be carried as records (None: it can).
    """
    routes = config.routes
    names = [r.name for r in routes]
    index = {name: i for i, name in enumerate(names)}
    errors: list[ConfigError] = []
    edges: list[set[int]] = [set() for _ in routes]
    for j, route in enumerate(routes):
        for k, output in enumerate(route.outputs):
            if not output.startswith(DERIVED_PREFIX):
                continue
            pattern = output[len(DERIVED_PREFIX) :]
            found = [i for i, name in enumerate(names) if fnmatchcase(name, pattern)]
            if not found:
                errors.append(
                    at(
                        ChainError(
                            f"route {route.name!r}: output {output!r} names no route "
                            f"(routes: {', '.join(names)})"
                        ),
                        f"routes[{j}].outputs[{k}]",
                    )
                )
            for i in found:
                edges[i].add(j)
    for i, route in enumerate(routes):
        for k, name in enumerate(route.then):
            if name not in index:
                errors.append(
                    at(
                        ChainError(
                            f"route {route.name!r}: then names {name!r}, which is not a route "
                            f"(routes: {', '.join(names)})"
                        ),
                        f"routes[{i}].then[{k}]",
                    )
                )
                continue
            edges[i].add(index[name])
    for i, targets in enumerate(edges):
        errors.extend(_fit_problems(config, i, targets, output_layouts, input_layouts))
        if targets and payload_problems[i] is not None:
            errors.append(
                at(
                    ChainError(
                        f"route {names[i]!r}: its output is routed again, but {payload_problems[i]}"
                    ),
                    f"routes[{i}]",
                )
            )
    cycles = _cycles(edges)
    cyclic = frozenset((i, j) for cycle in cycles for i in cycle for j in edges[i] if j in cycle)
    named_cycles = tuple(tuple(names[i] for i in sorted(cycle)) for cycle in cycles)
    if cycles and not config.allow_cycles:
        for cycle in named_cycles:
            errors.append(
                at(
                    ChainCycle(
                        f"routes {' -> '.join((*cycle, cycle[0]))} form a cycle (their output "
                        "comes back to them); refused unless allow_cycles=True, which bounds "
                        "it by the causal limits"
                    ),
                    "routes",
                )
            )
    sources = [set[str]() for _ in routes]
    for i, targets in enumerate(edges):
        for j in targets:
            sources[j].add(names[i])
    chains = Chains(
        targets=tuple(tuple(sorted(t)) for t in edges),
        sources=tuple(frozenset(s) for s in sources),
        cyclic=cyclic,
        cycles=named_cycles,
    )
    return chains, errors


def _fit_problems(
    config: RoutingConfig,
    i: int,
    targets: set[int],
    output_layouts: Sequence[str | None],
    input_layouts: Sequence[str | None],
) -> list[ConfigError]:
    routes = config.routes
    produced = output_layouts[i]
    problems: list[ConfigError] = []
    for j in sorted(targets):
        wanted = input_layouts[j]
        if routes[j].mode is RouteMode.FORWARD or wanted is None or produced is None:
            continue
        if wanted != produced:
            problems.append(
                at(
                    ChainError(
                        f"route {routes[j].name!r} takes the output of route "
                        f"{routes[i].name!r}: its processor reads layout {wanted!r}, but "
                        f"{routes[i].name!r} emits {produced!r}"
                    ),
                    f"routes[{j}]",
                )
            )
    return problems


def _cycles(edges: Sequence[set[int]]) -> list[list[int]]:
    """Strongly connected components that hold a cycle (Tarjan, iterative), each
    sorted, in order of their smallest route index."""
    n = len(edges)
    order = [-1] * n
    low = [0] * n
    on_stack = [False] * n
    stack: list[int] = []
    found: list[list[int]] = []
    counter = 0
    for start in range(n):
        if order[start] != -1:
            continue
        work = [(start, iter(sorted(edges[start])))]
        order[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack[start] = True
        while work:
            node, successors = work[-1]
            advanced = False
            for nxt in successors:
                if order[nxt] == -1:
                    order[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack[nxt] = True
                    work.append((nxt, iter(sorted(edges[nxt]))))
                    advanced = True
                    break
                if on_stack[nxt]:
                    low[node] = min(low[node], order[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == order[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack[member] = False
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in edges[node]:
                    found.append(sorted(component))
    return sorted(found, key=lambda c: c[0])
