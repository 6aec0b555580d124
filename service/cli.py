"""The ``taproute`` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from taproute.service.http import HttpConfig


def demo(sentences: int, data: Path, serve: bool, port: int) -> int:
    """Run all-MiniLM-L6-v2 with its captures routed into chDB (see taproute.service.demo)."""
    from taproute.service import demo as minilm_demo

    http = HttpConfig(port=port) if serve else None
    minilm_demo.run(data=data, count=sentences, http=http, serve_forever=serve)
    return 0


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
    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo(args.sentences, args.data, args.serve, args.port)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
