"""Config files: a TOML description of layouts, routes, destinations and
capacities, validated with cattrs (every problem reported with the file and
key path), then built into a running router.

::

    processors = ["my_server.taps"]          # modules that register processors

    [[layouts]]
    name = "query"
    columns = [{ name = "values", type = "Array(Float32)", shape = [16, 384] }]

    [[routes]]
    name = "raw"
    outputs = ["layers.*.attn.q"]
    destination = "clickhouse"

    [destinations.clickhouse]
    path = "taproute-data"                   # chDB; or url = "http://host:8123/db"
    raw = ["query"]

    [dead_letters]
    path = "dead-letters.sqlite"             # default: beside the first chDB destination

    [routing]
    unmatched = "drop"                       # or default_destination = "..."

    [ingress]
    capacity_records = 65536

    [http]
    port = 9464
    token = "..."                            # required by the mutating endpoints

    [[producer.hooks]]                       # what `taproute run` generates
    name = "layers.0.attn.q"
    layout = "query"
"""

from __future__ import annotations

import importlib
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import attrs
import cattrs
from cattrs.errors import IterableValidationError, IterableValidationNote

from taproute.actors import RoutingSink
from taproute.routing.errors import ConfigError, TaprouteError
from taproute.routing.failures import log_failure
from taproute.routing.hooks import HookRegistry
from taproute.routing.layout import Column, Layout
from taproute.routing.routes import Route, RoutingConfig
from taproute.routing.schema import RecordSchema
from taproute.routing.sink import RecordSink
from taproute.service.host.http import HttpConfig
from taproute.service.ops.dead_letters import DeadLetterStore
from taproute.service.sinks.clickhouse import Batching, ClickHouseSink, Retry


class ConfigFileError(ConfigError):
    """A config file is unreadable or invalid; the message lists every problem found."""

    def __init__(self, path: Path, problems: list[str]) -> None:
        self.path = path
        self.problems = problems
        listing = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{path}: {len(problems)} problem(s)\n{listing}")


@attrs.frozen
class ColumnConfig:
    name: str
    type: str
    shape: list[int] = attrs.Factory(list)


@attrs.frozen
class LayoutConfig:
    name: str
    columns: list[ColumnConfig]


@attrs.frozen
class RouteConfig:
    name: str
    outputs: list[str]
    destination: str
    mode: Literal["forward", "stateless", "stateful"] = "forward"
    processor: str | None = None
    capacity: int = 65_536
    capacity_bytes: int = 256 * 2**20
    workers: int = 1


@attrs.frozen
class BatchingConfig:
    max_rows: int = 1_000_000
    max_bytes: int = 10 * 2**20
    linger: float = 1.0
    inserts_in_flight: int = 2
    max_buffered_bytes: int = 256 * 2**20


@attrs.frozen
class RetryConfig:
    attempts: int = 8
    initial_backoff: float = 0.2
    max_backoff: float = 30.0


@attrs.frozen
class DestinationConfig:
    """A ClickHouse destination: ``path`` (chDB directory) or ``url`` (server)."""

    path: str | None = None
    url: str | None = None
    raw: list[str] = attrs.Factory(list)
    rows: list[str] = attrs.Factory(list)
    create_tables: bool | None = None
    require_deduplication: bool = True
    raw_table: str = "raw_{layout}"
    rows_table: str = "{layout}"
    batching: BatchingConfig = attrs.Factory(BatchingConfig)
    retry: RetryConfig = attrs.Factory(RetryConfig)


@attrs.frozen
class RoutingOptions:
    default_destination: str | None = None
    unmatched: Literal["default", "drop"] = "default"


@attrs.frozen
class IngressOptions:
    capacity_records: int = 65_536
    capacity_bytes: int = 256 * 2**20
    when_full: Literal["block", "reject"] = "block"


@attrs.frozen
class HttpOptions:
    host: str = "127.0.0.1"
    port: int = 9464
    token: str | None = attrs.field(default=None, repr=False)


@attrs.frozen
class DeadLetterOptions:
    """Where given-up records are kept (default: beside the first chDB destination)."""

    path: str | None = None


@attrs.frozen
class ProducerHook:
    """A hook `taproute run` feeds with random payloads of its layout."""

    name: str
    layout: str
    batch: int = 64
    elements: int = 256  # for a variable-length tail


@attrs.frozen
class ProducerConfig:
    hooks: list[ProducerHook] = attrs.Factory(list)


@attrs.frozen
class ServiceConfig:
    """A whole config file, structured and checked."""

    layouts: list[LayoutConfig]
    routes: list[RouteConfig]
    destinations: dict[str, DestinationConfig]
    processors: list[str] = attrs.Factory(list)
    routing: RoutingOptions = attrs.Factory(RoutingOptions)
    ingress: IngressOptions = attrs.Factory(IngressOptions)
    http: HttpOptions | None = None
    dead_letters: DeadLetterOptions = attrs.Factory(DeadLetterOptions)
    producer: ProducerConfig = attrs.Factory(ProducerConfig)
    source: Path = attrs.field(default=Path("<config>"), eq=False)

    def schema(self) -> RecordSchema:
        """The RecordSchema the layouts describe."""
        layouts = []
        for i, layout in enumerate(self.layouts):
            try:
                layouts.append(
                    Layout(
                        layout.name,
                        [Column(c.name, c.type, tuple(c.shape)) for c in layout.columns],
                    )
                )
            except ConfigError as exc:
                raise ConfigFileError(self.source, [f"{exc} @ layouts[{i}]"]) from None
        try:
            return RecordSchema(layouts)
        except ConfigError as exc:
            raise ConfigFileError(self.source, [f"{exc} @ layouts"]) from None

    def routing_config(self) -> RoutingConfig:
        """The routes, as RoutingConfig."""
        routes = []
        for i, r in enumerate(self.routes):
            try:
                routes.append(
                    Route(
                        r.name,
                        r.outputs,
                        r.destination,
                        mode=r.mode,
                        processor=r.processor,
                        capacity=r.capacity,
                        capacity_bytes=r.capacity_bytes,
                        workers=r.workers,
                    )
                )
            except ConfigError as exc:
                raise ConfigFileError(self.source, [f"{exc} @ routes[{i}]"]) from None
        try:
            return RoutingConfig(routes)
        except ConfigError as exc:
            raise ConfigFileError(self.source, [f"{exc} @ routes"]) from None

    def import_processors(self) -> None:
        """Import the modules that register this config's processors."""
        for i, module in enumerate(self.processors):
            try:
                importlib.import_module(module)
            except ImportError as exc:
                raise ConfigFileError(
                    self.source,
                    [f"cannot import processor module {module!r}: {exc} @ processors[{i}]"],
                ) from None

    def destination_factories(self, schema: RecordSchema) -> dict[str, Callable[[], RecordSink]]:
        """A factory per destination (the routing sink creates and owns them)."""
        return {
            name: _destination_factory(self.source, name, dest, schema)
            for name, dest in self.destinations.items()
        }

    def dead_letter_path(self) -> Path | None:
        """The dead-letter file: configured, else beside the first chDB destination."""
        if self.dead_letters.path is not None:
            return self._relative(self.dead_letters.path)
        for dest in self.destinations.values():
            if dest.path is not None:
                data = self._relative(dest.path)
                return data.with_name(data.name + "-dead-letters.sqlite")
        return None

    def _relative(self, path: str) -> Path:
        candidate = Path(path)
        return candidate if candidate.is_absolute() else self.source.parent / candidate

    def open_dead_letters(self, hooks: HookRegistry | None = None) -> DeadLetterStore | None:
        """The dead-letter store, if this config has one."""
        path = self.dead_letter_path()
        return None if path is None else DeadLetterStore(path, hooks=hooks)

    def build(self) -> tuple[RoutingSink, dict[str, Any]]:
        """The routing sink and the keyword arguments for ``create_record_runtime``."""
        self.import_processors()
        schema = self.schema()
        hooks = HookRegistry()
        store = self.open_dead_letters(hooks)
        try:
            sink = RoutingSink(
                self.routing_config(),
                schema,
                self.destination_factories(schema),
                self.routing.default_destination,
                unmatched=self.routing.unmatched,
                hooks=hooks,
                on_failure=log_failure if store is None else store.handle,
            )
        except ConfigFileError:
            raise
        except ConfigError as exc:  # every plan problem, at its own key path
            problems = [f"{message} @ {where or 'routes'}" for message, where in exc.located()]
            raise ConfigFileError(self.source, problems) from None
        runtime_kwargs: dict[str, Any] = {
            "capacity_records": self.ingress.capacity_records,
            "capacity_bytes": self.ingress.capacity_bytes,
            "when_full": self.ingress.when_full,
            "http": None
            if self.http is None
            else HttpConfig(self.http.host, self.http.port, self.http.token),
            "dead_letters": store,
        }
        return sink, runtime_kwargs

    def check_destinations(self) -> list[str]:
        """Build every destination once (checking its tables) and close it again.

        Returns one line per destination saying what was checked.
        """
        self.import_processors()
        schema = self.schema()
        lines = []
        for name, factory in self.destination_factories(schema).items():
            try:
                sink = factory()
            except TaprouteError as exc:
                raise ConfigFileError(self.source, [f"{exc} @ destinations.{name}"]) from None
            assert isinstance(sink, ClickHouseSink)
            lines.append(
                f"destination {name!r}: {sink.transport.description}, tables "
                f"{', '.join(sorted(sink.tables))} match the schema"
            )
            sink.transport.close()
        return lines


def _destination_factory(
    source: Path, name: str, dest: DestinationConfig, schema: RecordSchema
) -> Callable[[], RecordSink]:
    where = f"destinations.{name}"
    if (dest.path is None) == (dest.url is None):
        raise ConfigFileError(
            source, [f"give exactly one of path (chDB) or url (server) @ {where}"]
        )
    for key, names in (("raw", dest.raw), ("rows", dest.rows)):
        for i, layout in enumerate(names):
            if layout not in schema:
                raise ConfigFileError(source, [f"unknown layout {layout!r} @ {where}.{key}[{i}]"])
    batching = Batching(**attrs.asdict(dest.batching))
    retry = Retry(
        attempts=dest.retry.attempts,
        initial_backoff=dest.retry.initial_backoff,
        max_backoff=dest.retry.max_backoff,
    )
    options: dict[str, Any] = {
        "raw": dest.raw,
        "rows": dest.rows,
        "raw_table": dest.raw_table,
        "rows_table": dest.rows_table,
        "batching": batching,
        "retry": retry,
        "require_deduplication": dest.require_deduplication,
    }
    if dest.create_tables is not None:
        options["create_tables"] = dest.create_tables

    def make() -> RecordSink:
        if dest.path is not None:
            base = Path(dest.path)
            path = base if base.is_absolute() else source.parent / base
            return ClickHouseSink.embedded(schema, path, **options)
        return ClickHouseSink.server(schema, dest.url, **options)

    return make


_CONVERTER = cattrs.Converter(forbid_extra_keys=True)


def _strict_list(value: Any, list_type: Any) -> list[Any]:
    # cattrs would turn "vec" into ["v", "e", "c"]; a lone string is a mistake.
    if isinstance(value, str | bytes | dict) or not hasattr(value, "__iter__"):
        raise ValueError(f"expected a list, got {type(value).__name__} {value!r}")
    (item_type,) = list_type.__args__
    items, errors = [], []
    for index, item in enumerate(value):
        try:
            items.append(_CONVERTER.structure(item, item_type))
        except Exception as exc:  # keep the index in the key path, as cattrs does
            note = IterableValidationNote(
                f"Structuring {list_type} @ index {index}", index, item_type
            )
            exc.__notes__ = [*getattr(exc, "__notes__", []), note]
            errors.append(exc)
    if errors:
        raise IterableValidationError(f"While structuring {list_type!r}", errors, list_type)
    return items


_CONVERTER.register_structure_hook_func(
    lambda t: getattr(t, "__origin__", None) is list, _strict_list
)


def load_config(path: str | Path) -> ServiceConfig:
    """Read and structure a TOML config; raise :class:`ConfigFileError` listing every problem."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigFileError(path, [f"cannot read: {exc.strerror or exc}"]) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigFileError(path, [f"not valid TOML: {exc}"]) from None
    try:
        config = _CONVERTER.structure(raw, ServiceConfig)
    except cattrs.ClassValidationError as exc:
        problems = [
            message.replace(" @ $", " @ ").replace("@ .", "@ ")
            for message in cattrs.transform_error(exc, path="$")
        ]
        raise ConfigFileError(path, problems) from None
    return attrs.evolve(config, source=path)
