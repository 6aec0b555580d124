"""The ``taproute`` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from taproute.service.config import ConfigFileError, load_config
from taproute.service.http import HttpConfig


def demo(sentences: int, data: Path, serve: bool, port: int) -> int:
    """Run all-MiniLM-L6-v2 with its captures routed into chDB (see taproute.service.demo)."""
    from taproute.service import demo as minilm_demo

    http = HttpConfig(port=port) if serve else None
    minilm_demo.run(data=data, count=sentences, http=http, serve_forever=serve)
    return 0


def check(path: Path) -> int:
    """Validate a config file and every destination's tables."""
    try:
        config = load_config(path)
        config.build()
        lines = config.check_destinations()
    except ConfigFileError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"{path}: {len(config.routes)} route(s), {len(config.layouts)} layout(s) OK")
    for line in lines:
        print(f"  {line}")
    return 0


def run(path: Path, rate: float, duration: float) -> int:
    """Drive the configured router from a synthetic producer while serving HTTP."""
    from taproute.service.load import run_load

    try:
        config = load_config(path)
        counters = run_load(config, rate=rate, duration=duration)
    except ConfigFileError as exc:
        print(exc, file=sys.stderr)
        return 1
    for route in counters.routes.values():
        print(
            f"route {route.name}: processed {route.processed:,}, emitted {route.emitted:,}, "
            f"failed {route.failed:,}"
        )
    return 0 if counters.failure is None else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``taproute`` command."""
    parser = argparse.ArgumentParser(prog="taproute", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser(
        "demo", help="capture a real transformer's activations, route them into chDB, query"
    )
    demo_parser.add_argument("--sentences", type=int, default=320)
    demo_parser.add_argument("--data", type=Path, default=Path("taproute-data"))
    demo_parser.add_argument("--serve", action="store_true", help="keep /metrics up after")
    demo_parser.add_argument("--port", type=int, default=9464)
    check_parser = commands.add_parser("check", help="validate a config and its destinations")
    check_parser.add_argument("--config", type=Path, required=True)
    run_parser = commands.add_parser(
        "run", help="drive a configured router with synthetic records, serving HTTP"
    )
    run_parser.add_argument("--config", type=Path, required=True)
    run_parser.add_argument("--rate", type=float, default=10_000.0, help="records per second")
    run_parser.add_argument("--duration", type=float, default=10.0, help="seconds")
    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo(args.sentences, args.data, args.serve, args.port)
    if args.command == "check":
        return check(args.config)
    if args.command == "run":
        return run(args.config, args.rate, args.duration)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
