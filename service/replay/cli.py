"""``taproute replay``: the command-line face of :func:`replay`.

::

    taproute replay --schema taproute.service.demo.processors:SCHEMA \\
        --processor demo.head_norms --chdb taproute-data --layout activations \\
        --output head_norms=parquet:out/head_norms --backend processes --workers 2
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import json
import sys
from pathlib import Path
from typing import Any

from taproute.routing.errors import ConfigError
from taproute.routing.schema import RecordSchema
from taproute.service.replay.config import ReplayConfig
from taproute.service.replay.corpus import ClickHouseCorpus, Corpus, ParquetCorpus
from taproute.service.replay.errors import ReplayConfigError, UnitsFailed
from taproute.service.replay.lanes import parse_target
from taproute.service.replay.runner import config_digest, run_replay
from taproute.service.replay.units import Filters
from taproute.service.sinks.clickhouse.transport import ChdbTransport, ServerTransport, Transport


def add_parser(commands: Any) -> None:
    """Add the ``replay`` subcommand to the ``taproute`` parser."""
    p = commands.add_parser(
        "replay", help="run a registered processor over a stored corpus (checkpointed, resumable)"
    )
    p.add_argument("--processor", required=True, help="registered processor name")
    p.add_argument("--schema", required=True, help="MODULE:NAME of the RecordSchema")
    p.add_argument(
        "--import",
        dest="modules",
        action="append",
        default=[],
        metavar="MODULE",
        help="module that registers processors (repeatable; the schema's is implied)",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--chdb", type=Path, help="chDB data directory holding the raw table")
    src.add_argument("--url", help="ClickHouse server URL holding the raw table")
    src.add_argument("--parquet", nargs="+", help="Parquet files or globs (raw table columns)")
    p.add_argument("--layout", required=True, help="the corpus's payload layout")
    p.add_argument("--table", help="raw table (default raw_<layout>)")
    p.add_argument(
        "--into",
        help="chDB directory or server URL for ClickHouse lanes (default: the corpus's ClickHouse)",
    )
    p.add_argument("--hook", action="append", default=[], metavar="GLOB")
    p.add_argument("--keys", metavar="LO:HI", help="key range [LO, HI)")
    p.add_argument("--steps", metavar="LO:HI", help="step range [LO, HI)")
    p.add_argument("--since", help="capture time from (ISO 8601, UTC if no zone)")
    p.add_argument("--until", help="capture time until, exclusive (ISO 8601)")
    p.add_argument(
        "--output",
        action="append",
        default=[],
        metavar="LANE=TARGET",
        help="lane target: clickhouse:TABLE or parquet:DIR (repeatable)",
    )
    p.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="processor param (VALUE parsed as JSON when it parses)",
    )
    p.add_argument(
        "--on-bind",
        action="append",
        default=[],
        metavar="MODULE:FUNCTION",
        help="hook-binding listener, as the live program subscribes it",
    )
    p.add_argument("--backend", default="inprocess", choices=["inprocess", "processes", "ray"])
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--schedule", default="static", choices=["static", "pull"])
    p.add_argument("--unit-rows", type=int, default=4096)
    p.add_argument("--checkpoint-units", type=int, default=16)
    p.add_argument("--checkpoint-seconds", type=float, default=30.0)
    p.add_argument("--retries", type=int, default=2)
    p.add_argument("--stateful-output", default="auto", choices=["auto", "units", "final"])
    p.add_argument("--runs", type=Path, help="ledger directory (default: beside the outputs)")
    p.add_argument("--resume", metavar="RUN_ID", help="continue a run: finished units are skipped")
    p.add_argument("--dry-run", action="store_true", help="validate and print the plan only")


def _attribute(spec: str, what: str) -> Any:
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ReplayConfigError(f"{what} {spec!r}: expected MODULE:NAME")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ReplayConfigError(f"{what} {spec!r}: {exc}") from None


def _range(text: str | None, what: str) -> tuple[int, int] | None:
    if text is None:
        return None
    lo, sep, hi = text.partition(":")
    try:
        if sep:
            return (int(lo), int(hi))
    except ValueError:
        pass
    raise ReplayConfigError(f"--{what} {text!r}: expected LO:HI (integers)")


def _time_ns(text: str) -> int:
    try:
        moment = dt.datetime.fromisoformat(text)
    except ValueError:
        raise ReplayConfigError(f"time {text!r}: expected ISO 8601") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.UTC)
    return int(moment.timestamp() * 1_000_000) * 1000


def _transport(where: str) -> Transport:
    if where.startswith(("http://", "https://")):
        return ServerTransport(where)
    return ChdbTransport(where)


def _param(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ReplayConfigError(f"--param {text!r}: expected KEY=VALUE")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def config_from_args(args: argparse.Namespace) -> ReplayConfig:
    """A :class:`ReplayConfig` from the parsed command line."""
    schema = _attribute(args.schema, "--schema")
    if not isinstance(schema, RecordSchema):
        raise ReplayConfigError(
            f"--schema {args.schema!r} is a {type(schema).__name__}, not a RecordSchema"
        )
    modules = (args.schema.partition(":")[0], *args.modules)
    time_ns = None
    if args.since or args.until:
        time_ns = (
            _time_ns(args.since) if args.since else 0,
            _time_ns(args.until) if args.until else 2**62,
        )
    filters = Filters(
        hooks=args.hook,
        keys=_range(args.keys, "keys"),
        steps=_range(args.steps, "steps"),
        time_ns=time_ns,
    )
    source: Corpus
    clickhouse: Transport | None = None
    if args.parquet:
        source = ParquetCorpus(args.parquet, args.layout, filters=filters)
    else:
        transport = _transport(str(args.chdb) if args.chdb is not None else args.url)
        source = ClickHouseCorpus(transport, args.layout, table=args.table, filters=filters)
        clickhouse = transport
    if args.into:
        clickhouse = _transport(args.into)
    outputs = {}
    for item in args.output:
        lane, sep, target = item.partition("=")
        if not sep:
            raise ReplayConfigError(
                f"--output {item!r}: expected LANE=clickhouse:TABLE|parquet:DIR"
            )
        outputs[lane] = parse_target(target)
    return ReplayConfig(
        source=source,
        processor=args.processor,
        schema=schema,
        outputs=outputs,
        clickhouse=clickhouse,
        params=dict(_param(p) for p in args.param),
        modules=modules,
        on_bind=tuple(_attribute(s, "--on-bind") for s in args.on_bind),
        backend=args.backend,
        workers=args.workers,
        schedule=args.schedule,
        unit_rows=args.unit_rows,
        checkpoint_units=args.checkpoint_units,
        checkpoint_seconds=args.checkpoint_seconds,
        retries=args.retries,
        runs_dir=args.runs,
        stateful_output=args.stateful_output,
    )


#: Exit code of bad input (arguments, or what they name), as every subcommand's.
BAD_INPUT = 2


def main(args: argparse.Namespace) -> int:
    """Run the subcommand; 1 when units failed (the message lists them), 2 when
    it is configured wrongly (an argument, or what it names), before any unit."""
    try:
        return _main(args)
    except ConfigError as exc:  # ReplayConfigError, an unknown processor, a bad layout
        print(f"taproute: {type(exc).__name__}: {exc}", file=sys.stderr)
        return BAD_INPUT


def _main(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    if args.dry_run:
        report = run_replay(config, dry_run=True)
        print(report.describe())
        print(f"config hash: {config_digest(config)}")
        return 0
    try:
        report = run_replay(config, resume=args.resume)
    except UnitsFailed as exc:
        print(exc.report.describe())  # type: ignore[attr-defined]
        print(exc, file=sys.stderr)
        return 1
    print(report.describe())
    return 0
