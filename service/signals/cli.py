"""``taproute report``: the signal tables as PNG charts and an index page."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_parser(commands: Any) -> None:
    """Add ``report`` to the ``taproute`` command's subcommands."""
    parser = commands.add_parser(
        "report", help="charts of the signal tables (Q/K spectra, experts, pathways, TwoNN)"
    )
    parser.add_argument("--data", type=Path, default=Path("taproute-data"), help="chDB directory")
    parser.add_argument("--url", help="a ClickHouse server instead (http://user:pass@host:8123/db)")
    parser.add_argument("--out", type=Path, default=Path("taproute-report"))
    parser.add_argument("--prefix", default="", help="table name prefix")


def main(args: argparse.Namespace) -> int:
    """Write the charts and ``index.html`` into ``--out``; print what was written."""
    from taproute.service.signals.report import write_report
    from taproute.service.sinks.clickhouse import ChdbTransport, ServerTransport
    from taproute.service.sinks.clickhouse.transport import Transport

    transport: Transport = ServerTransport(args.url) if args.url else ChdbTransport(args.data)
    try:
        written = write_report(transport, args.out, prefix=args.prefix)
    finally:
        transport.close()
    for path in written:
        print(path)
    return 0
