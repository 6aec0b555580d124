"""Config files: layouts, routes, destinations and capacities in TOML, read
into the library's own value classes, checked, then built into a service.

::

    processors = ["my_server.taps"]          # modules that register processors

    [[layouts]]
    name = "query"
    columns = [{ name = "values", type = "Array(Float32)", shape = [16, 384] }]

    [[routes]]
    name = "raw"
    outputs = ["layers.*.attn.q"]
    destination = "clickhouse"

    [routes.failure_policy]                  # optional; FailurePolicy's fields
    deadline = 2.0                           # seconds per processor call
    max_failures = 3
    multiplier = 1.5

    [destinations.clickhouse]
    path = "taproute-data"                   # chDB; or url = "http://host:8123/db"
    raw = ["query"]

    [dead_letters]
    path = "dead-letters.sqlite"             # default: beside the first chDB destination
    lock_bound = 300.0                       # seconds a write waits out a locked file

    [routing]
    unmatched = "drop"                       # or default_destination = "..."

    [ingress]
    capacity_records = 65536

    [shutdown]
    grace = 30.0                             # seconds close may take (see ShutdownOptions)

    [http]
    port = 9464
    token = "..."                            # required by the mutating endpoints

    [[producer.hooks]]                       # what `taproute run` generates
    name = "layers.0.attn.q"
    layout = "query"

A ``[[routes]]`` table is a :class:`~taproute.routing.routes.Route`, its
``failure_policy`` a :class:`~taproute.routing.failures.FailurePolicy`, a
layout a :class:`~taproute.routing.layout.Layout`, ``batching``/``retry`` of a
destination the sink's :class:`Batching`/:class:`Retry`, ``[http]`` an
:class:`HttpConfig`: one set of classes, whose field names are the keys.
:func:`load_config` reads and checks a file without side effects;
:meth:`ServiceConfig.build` imports processors, opens the dead-letter store and
returns a :class:`BuiltService`.
"""

from __future__ import annotations

import importlib
import os
import sqlite3
import sys
import tomllib
from collections.abc import Callable, Iterator, Mapping
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import attrs
from cattrs.errors import ClassValidationError

from taproute.actors import RoutingSink
from taproute.routing.errors import ConfigError, TaprouteError
from taproute.routing.failures import FAILURE_POLICY_LIMITS, log_failure
from taproute.routing.hooks import HookRegistry
from taproute.routing.layout import Layout
from taproute.routing.plan import RoutePlan
from taproute.routing.routes import DERIVED_PREFIX, Route, RoutingConfig
from taproute.routing.schema import RecordSchema
from taproute.routing.sink import RecordSink
from taproute.service.host.built_service import BuiltService
from taproute.service.host.config_destinations import (
    DestinationConfig,
    chdb_holder,
    check_spool,
    destination_problems,
    open_destination,
    prepare_directory,
    spooled,
)
from taproute.service.host.config_rules import (
    ConfigFileError,
    omit,
    problems_of,
    structure,
)
from taproute.service.host.config_sections import (
    DeadLetterOptions,
    IngressOptions,
    ProducerConfig,
    ProducerHook,
    RoutingOptions,
    ShutdownOptions,
)
from taproute.service.host.http import HttpConfig
from taproute.service.ops.dead_letters import DeadLetterStore, DeadLetterStoreError
from taproute.service.ops.parking import ParkedRecordStore
from taproute.service.sinks.writer import WriterProcessSink


@attrs.frozen(kw_only=True)
class ServiceConfig:
    """A whole config file, structured and checked (``source``: the file)."""

    layouts: tuple[Layout, ...]
    routes: tuple[Route, ...]
    destinations: dict[str, DestinationConfig]
    processors: tuple[str, ...] = ()
    routing: RoutingOptions = attrs.Factory(RoutingOptions)
    ingress: IngressOptions = attrs.Factory(IngressOptions)
    shutdown: ShutdownOptions = attrs.Factory(ShutdownOptions)
    http: HttpConfig | None = None
    dead_letters: DeadLetterOptions = attrs.Factory(DeadLetterOptions)
    producer: ProducerConfig = attrs.Factory(ProducerConfig)
    source: Path = attrs.field(default=Path("<config>"), eq=False)

    def schema(self) -> RecordSchema:
        """The RecordSchema the layouts describe."""
        try:
            return RecordSchema(self.layouts)
        except ConfigError as exc:
            raise ConfigFileError(self.source, [f"layouts: {exc}"]) from None

    def routing_config(self) -> RoutingConfig:
        """The routes, as RoutingConfig."""
        try:
            return RoutingConfig(
                self.routes,
                allow_cycles=self.routing.allow_cycles,
                causal_limits=self.routing.causal_limits,
            )
        except ConfigError as exc:
            raise ConfigFileError(self.source, [f"routes: {exc}"]) from None

    def with_call_timeout(self, seconds: float) -> ServiceConfig:
        """This config with every route's processor deadline set to ``seconds``."""
        problem = FAILURE_POLICY_LIMITS["deadline"].problem(seconds)
        if problem is not None:
            raise ConfigFileError(self.source, [f"--call-timeout {problem}"])
        routes = tuple(
            attrs.evolve(r, failure_policy=attrs.evolve(r.failure_policy, deadline=seconds))
            for r in self.routes
        )
        return attrs.evolve(self, routes=routes)

    def import_processors(self) -> None:
        """Import the modules that register this config's processors; raise
        :class:`ConfigFileError` listing every module that failed."""
        problems = self._import_problems()
        if problems:
            raise ConfigFileError(self.source, problems)

    def _import_problems(self) -> list[str]:
        self._put_own_folder_on_path()
        problems = []
        for i, module in enumerate(self.processors):
            try:
                importlib.import_module(module)
            except Exception as exc:  # a module's own bug is the file's problem here
                detail = str(exc).splitlines()[0] if str(exc) else ""
                problems.append(
                    f"processors[{i}]: cannot import processor module {module!r}: "
                    f"{type(exc).__name__}: {detail}".rstrip(": ")
                )
        return problems

    def _put_own_folder_on_path(self) -> None:
        """Processor modules beside the config file are found, as a script's
        are beside it: the file's folder goes first on the import path (once;
        not for a config read from a string)."""
        if not self.source.is_file():
            return
        folder = str(self.source.resolve().parent)
        if folder not in sys.path:
            sys.path.insert(0, folder)

    def _imported(self) -> RecordSchema:
        """Import the processors and build the schema; a module that cannot be
        imported is listed with the routes' problems (found without opening
        anything), not alone: its routes' processors are then unknown too."""
        problems = self._import_problems()
        schema = self.schema()
        if problems:
            try:
                RoutePlan(
                    self.routing_config(),
                    schema,
                    destinations=self.destinations,
                    default_destination=self.routing.default_destination,
                    unmatched=self.routing.unmatched,
                )
            except ConfigFileError as exc:
                problems += exc.problems
            except ConfigError as exc:
                problems += plan_problems(exc)
            raise ConfigFileError(self.source, problems)
        return schema

    def destination_factories(
        self, schema: RecordSchema, dead_letters: DeadLetterStore | None = None
    ) -> dict[str, Callable[[], RecordSink]]:
        """A factory per destination (the routing sink creates and owns them);
        what a destination refuses goes to ``dead_letters``."""
        return {
            name: _factory(self.source, name, dest, schema, dead_letters)
            for name, dest in self.destinations.items()
        }

    def dead_letter_location(self) -> tuple[Path, str] | None:
        """The dead-letter file and the key that decides it, or None."""
        if self.dead_letters.path is not None:
            return self._relative(self.dead_letters.path), "dead_letters.path"
        for name, dest in self.destinations.items():
            if dest.path is not None:
                data = self._relative(dest.path)
                where = f"dead_letters.path (default: beside destinations.{name}.path)"
                return data.with_name(data.name + "-dead-letters.sqlite"), where
        return None

    def dead_letter_path(self) -> Path | None:
        """The dead-letter file: configured, else beside the first chDB destination."""
        location = self.dead_letter_location()
        return None if location is None else location[0]

    def _relative(self, path: str) -> Path:  # relative paths are relative to the file
        candidate = Path(path)
        return candidate if candidate.is_absolute() else self.source.parent / candidate

    def open_dead_letters(self, hooks: HookRegistry | None = None) -> DeadLetterStore | None:
        """The dead-letter store (created if missing), if this config has one."""
        location = self.dead_letter_location()
        if location is None:
            return None
        path, where = location
        prepare_directory(self.source, path.parent, where)
        try:
            return DeadLetterStore(
                path,
                hooks=hooks,
                busy_timeout=self.dead_letters.busy_timeout,
                lock_bound=self.dead_letters.lock_bound,
            )
        except DeadLetterStoreError as exc:  # names the path and why
            raise ConfigFileError(self.source, [f"{where}: {exc}"]) from None
        except (OSError, sqlite3.Error, TaprouteError) as exc:
            raise ConfigFileError(self.source, [f"{where}: cannot open {path}: {exc}"]) from None

    def build(self) -> BuiltService:
        """Import processors, prepare destination directories, open the dead-letter
        store and build the routing sink (inert until started)."""
        schema = self._imported()
        for name, dest in self.destinations.items():
            if dest.path is not None:
                prepare_directory(
                    self.source, self._relative(dest.path), f"destinations.{name}.path"
                )
        hooks = HookRegistry()
        store = self.open_dead_letters(hooks)
        # Records parked for a retry are kept in the dead-letter file too; a
        # give-up moves them to the letters in one transaction.
        try:
            parking = None if store is None else ParkedRecordStore(store)
        except DeadLetterStoreError as exc:  # names the path and why
            assert store is not None
            store.close()
            location = self.dead_letter_location()
            where = "dead_letters.path" if location is None else location[1]
            raise ConfigFileError(self.source, [f"{where}: {exc}"]) from None
        try:
            sink = RoutingSink(
                self.routing_config(),
                schema,
                self.destination_factories(schema, store),
                self.routing.default_destination,
                unmatched=self.routing.unmatched,
                hooks=hooks,
                on_failure=log_failure if parking is None else parking.handle,
                park=parking,
            )
        except ConfigError as exc:  # every plan problem, at its own key path
            if store is not None:
                store.close()
            if isinstance(exc, ConfigFileError):
                raise
            raise ConfigFileError(self.source, plan_problems(exc)) from None
        return BuiltService(config=self, sink=sink, http=self.http, dead_letters=store)

    def candidate_sink(self) -> RoutingSink:
        """The routing sink this file describes, to trace as a candidate: built and
        checked (processors imported), never run; no directory, store or
        destination is opened or created.  Problems raise :class:`ConfigFileError`."""
        schema = self._imported()
        try:
            return RoutingSink(
                self.routing_config(),
                schema,
                self.destination_factories(schema, None),
                self.routing.default_destination,
                unmatched=self.routing.unmatched,
            )
        except ConfigFileError:
            raise
        except ConfigError as exc:
            raise ConfigFileError(self.source, plan_problems(exc)) from None

    def check_destinations(self, *, running: bool = False) -> list[str]:
        """Build every destination once (checking its tables) and close it again.

        Returns one line per destination saying what was checked.  With
        ``running`` (the file's service runs now: ``taproute check --url``), a
        chDB directory another process holds is that service's, said as such
        and not opened (chDB allows one process per directory).
        """
        self.import_processors()
        schema = self.schema()
        lines = []
        for name, dest in self.destinations.items():
            path = dest.path_under(self.source.parent)
            holder = chdb_holder(path) if running and path is not None else None
            if holder is not None:
                lines.append(
                    f"destination {name!r}: chDB at {path} is open in process {holder} "
                    "(the running service): tables not checked from here"
                )
                continue
            sink = open_destination(
                self.source, name, dest, schema, dest.path_under(self.source.parent)
            )
            tables = ", ".join(sorted(sink.tables))
            if isinstance(sink, WriterProcessSink):
                where = f"{sink.config.where} (checked by a writer process)"
                sink.close_unstarted()
            else:
                where = sink.transport.description
                sink.transport.close()
            check_spool(self.source, name, dest, running=running)  # as the start opens it
            lines.append(f"destination {name!r}: {where}, tables {tables} match the schema")
        return lines


def plan_problems(error: ConfigError) -> list[str]:
    """A routing sink's build problems as a config file's lines (key path: message)."""
    return [f"{_key(where)}: {message}" for message, where in error.located()]


def _key(where: str | None) -> str:
    """A routing sink's problem location as this file's key path."""
    if where is None:
        return "routes"
    return f"routing.{where}" if where in ("default_destination", "unmatched") else where


def _factory(
    source: Path,
    name: str,
    dest: DestinationConfig,
    schema: RecordSchema,
    dead_letters: DeadLetterStore | None,
) -> Callable[[], RecordSink]:
    path = dest.path_under(source.parent)

    # A spooled server destination starts while its server is down: batches
    # spool, its tables are checked when the server is first reached.
    later = dest.spool != "off" and dest.writer == "thread"

    def make() -> RecordSink:
        inner = open_destination(source, name, dest, schema, path, check_later=later)
        return spooled(source, name, dest, inner, dead_letters)

    return make


omit(ServiceConfig, "source")


def _semantic_problems(config: ServiceConfig) -> Iterator[str]:
    """What the types allow but the file still gets wrong (no side effects)."""
    names = [layout.name for layout in config.layouts]
    for i, layout in enumerate(config.layouts):
        try:
            layout.dtype  # noqa: B018 - numpy refuses sizes past its limits
        except (ValueError, TypeError) as exc:
            yield f"layouts[{i}]: layout {layout.name!r} has no numpy dtype: {exc}"
    if len(set(names)) != len(names):
        yield f"layouts: duplicate layout names in {names}"
    spools: dict[Path, str] = {}  # a spool directory has one writer: one destination
    for name, dest in config.destinations.items():
        yield from destination_problems(name, dest, set(names))
        if dest.spool != "off":
            directory = Path(os.path.abspath(dest.spool_directory(config.source.parent, name)))
            if directory in spools:
                yield (
                    f"destinations.{name}.spool_dir: {directory} is also the spool of "
                    f"destinations.{spools[directory]} (a spool has one writer: give each "
                    "destination its own)"
                )
            spools.setdefault(directory, name)
        if dest.spool_when_full == "dead_letter" and config.dead_letter_location() is None:
            yield _needs_dead_letters(name)
    for i, route in enumerate(config.routes):
        yield from _narrow_problems(i, route.name, route.narrow, names)
    for i, hook in enumerate(config.producer.hooks):
        if not hook.name:  # refused only once run bound it (HookBindingError, exit 1)
            yield f"producer.hooks[{i}].name: must be a non-empty hook name"
        if hook.layout not in names:
            yield f"producer.hooks[{i}].layout: unknown layout {hook.layout!r} (have {names})"
            continue
        try:
            config.layouts[names.index(hook.layout)].check_payload_layout()
        except ConfigError as exc:
            yield f"producer.hooks[{i}].layout: {exc}"


def load_config(path: str | Path, *, data: bytes | None = None) -> ServiceConfig:
    """Read and check a TOML config; raise :class:`ConfigFileError` listing every problem.

    Reads only: imports no processor module, creates no file.  ``data``: the
    file's bytes, already read (a reload hashes what it checks).
    """
    path = Path(path)
    if data is None:
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ConfigFileError(path, [f"cannot read: {exc.strerror or exc}"]) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ConfigFileError(
            path, [f"not UTF-8: byte 0x{data[exc.start]:02x} at offset {exc.start} (line {line})"]
        ) from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigFileError(path, [f"not valid TOML: {exc}"]) from None
    try:
        config: ServiceConfig = structure(raw, ServiceConfig)
    except ClassValidationError as exc:
        # Listed with the references that can be read despite the bad values.
        raise ConfigFileError(path, problems_of(exc) + reference_problems(raw)) from None
    config = attrs.evolve(config, source=path)
    problems = list(_semantic_problems(config))
    if problems:  # semantic ones check the layout references already (and the dead letters')
        references = reference_problems(raw, layouts=False)
        raise ConfigFileError(path, list(dict.fromkeys(problems + references)))
    return config


def _needs_dead_letters(destination: object) -> str:
    return (
        f"destinations.{destination}.spool_when_full: 'dead_letter' needs a dead-letter "
        "store: set dead_letters.path (none is implied without a chDB destination)"
    )


def reference_problems(raw: object, *, layouts: bool = True) -> list[str]:
    """Names one section gives that another must define, read from the file's
    raw tables, so they are reported with its type and bound problems instead
    of in a later round: a route's destination and ``routing.default_destination``
    among ``[destinations]`` (and the latter given while ``unmatched`` is
    ``"default"``); ``route:`` outputs and ``then`` among the routes' names;
    with ``layouts``, routes' ``narrow``, destinations' ``raw``/``rows`` and
    producer hooks' ``layout`` among the layouts.  A reference is checked wherever both its ends
    can be read (a name that is a string, a section that is a table), whatever
    the values beside it; the messages are the build's.

    Not here: processor names (processors register when their modules are
    imported, which reading a file does not do; the build reports them, with
    every other routing problem).
    """
    if not isinstance(raw, dict):
        return []
    problems: list[str] = []
    destinations = raw.get("destinations")
    known = sorted(destinations) if isinstance(destinations, dict) else None
    routes = _tables(raw.get("routes"))
    names = [route.get("name") for _, route in routes]
    route_names = [name for name in names if isinstance(name, str)]
    for i, route in routes:
        name = route.get("name")
        destination = route.get("destination")
        if known is not None and isinstance(destination, str) and destination not in known:
            problems.append(
                f"routes[{i}]: route {name!r}: unknown destination {destination!r}; given {known}"
            )
        if len(route_names) != len(names):
            continue  # a route without a readable name: chains cannot be resolved
        listed = ", ".join(route_names)
        for k, output in _strings(route.get("outputs")):
            pattern = output.removeprefix(DERIVED_PREFIX)
            if output.startswith(DERIVED_PREFIX) and not any(
                fnmatchcase(n, pattern) for n in route_names
            ):
                problems.append(
                    f"routes[{i}].outputs[{k}]: route {name!r}: output {output!r} names no "
                    f"route (routes: {listed})"
                )
        for k, target in _strings(route.get("then")):
            if target not in route_names:
                problems.append(
                    f"routes[{i}].then[{k}]: route {name!r}: then names {target!r}, which is "
                    f"not a route (routes: {listed})"
                )
    # A destination shedding into the dead letters needs a store: configured,
    # or implied beside a chDB destination.
    dead_letters = raw.get("dead_letters")
    tables = destinations.values() if isinstance(destinations, dict) else ()
    if not (
        isinstance(dead_letters, dict) and isinstance(dead_letters.get("path"), str)
    ) and not any(isinstance(dest, dict) and isinstance(dest.get("path"), str) for dest in tables):
        for dest_name, dest in (destinations if isinstance(destinations, dict) else {}).items():
            if isinstance(dest, dict) and dest.get("spool_when_full") == "dead_letter":
                problems.append(_needs_dead_letters(dest_name))
    routing = raw.get("routing", {})
    if isinstance(routing, dict) and routing.get("unmatched", "default") == "default":
        default = routing.get("default_destination")
        if default is None:
            problems.append(
                "routing.default_destination: no default_destination for unmatched records; "
                "name one, or pass unmatched='drop' to drop (and count) records no route takes"
            )
        elif known is not None and isinstance(default, str) and default not in known:
            problems.append(
                f"routing.default_destination: default_destination {default!r} is not among "
                f"the destinations {known}"
            )
    layout_tables = _tables(raw.get("layouts")) if isinstance(raw.get("layouts"), list) else None
    if not layouts or layout_tables is None:
        return problems
    layout_names = [layout.get("name") for _, layout in layout_tables]
    if not all(isinstance(n, str) for n in layout_names):
        return problems  # a layout without a readable name: any reference may be to it
    defined = [str(n) for n in layout_names]
    for i, route in routes:
        narrow = route.get("narrow")
        if isinstance(narrow, dict):
            pairs = {k: v for k, v in narrow.items() if isinstance(v, str)}
            problems += _narrow_problems(i, route.get("name"), pairs, defined)
    for dest_name, dest in (destinations or {}).items():
        if not isinstance(dest, dict):
            continue
        for key in ("raw", "rows"):
            for k, layout in _strings(dest.get(key)):
                if layout not in layout_names:
                    problems.append(
                        f"destinations.{dest_name}.{key}[{k}]: unknown layout {layout!r}"
                    )
    producer = raw.get("producer")
    for i, hook in _tables(producer.get("hooks") if isinstance(producer, dict) else None):
        named = hook.get("layout")
        if isinstance(named, str) and named not in layout_names:
            problems.append(
                f"producer.hooks[{i}].layout: unknown layout {named!r} (have {layout_names})"
            )
    return problems


def _narrow_problems(
    index: int, route: object, narrow: Mapping[str, str], layouts: list[str]
) -> list[str]:
    """Every layout a route's ``narrow`` names that ``layouts`` lacks, in the
    build's words (:meth:`Narrowing.build` stops at the first)."""
    return [
        f"routes[{index}]: route {route!r}, narrow: unknown layout {name!r}; "
        f"the schema defines {sorted(layouts)}"
        for pair in narrow.items()
        for name in pair
        if name not in layouts
    ]


def _tables(value: object) -> list[tuple[int, dict[str, Any]]]:
    """The tables of an array of tables, with their index (others skipped)."""
    if not isinstance(value, list):
        return []
    return [(i, item) for i, item in enumerate(value) if isinstance(item, dict)]


def _strings(value: object) -> list[tuple[int, str]]:
    """The strings of an array, with their index (others skipped)."""
    if not isinstance(value, list):
        return []
    return [(i, item) for i, item in enumerate(value) if isinstance(item, str)]


__all__ = [
    "BuiltService",
    "ConfigFileError",
    "DeadLetterOptions",
    "DestinationConfig",
    "IngressOptions",
    "ProducerConfig",
    "ProducerHook",
    "RoutingOptions",
    "ServiceConfig",
    "ShutdownOptions",
    "load_config",
]
