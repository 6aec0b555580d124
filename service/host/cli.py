"""The ``taproute`` command: demo, check, run, trace, dead-letters, replay."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from taproute.routing.errors import TaprouteError
from taproute.service.host.config import ConfigFileError, ServiceConfig, load_config
from taproute.service.host.http import HttpConfig
from taproute.service.ops.dead_letters import DeadLetterStore

#: Dead letters older than this are reported by ``taproute check``.
STALE_DEAD_LETTER_SECONDS = 600.0


def demo(sentences: int, data: Path, serve: bool, port: int) -> int:
    """Run all-MiniLM-L6-v2 with its captures routed into chDB (see taproute.service.demo)."""
    from taproute.service.demo import run as minilm_demo

    http = HttpConfig(port=port) if serve else None
    minilm_demo.run(data=data, count=sentences, http=http, serve_forever=serve)
    return 0


def check(path: Path) -> int:
    """Validate a config file and every destination's tables; warn about old dead letters."""
    config = load_config(path)
    _, runtime_kwargs = config.build()
    store = runtime_kwargs["dead_letters"]
    lines = config.check_destinations()
    print(f"{path}: {len(config.routes)} route(s), {len(config.layouts)} layout(s) OK")
    for line in lines:
        print(f"  {line}")
    if store is not None:
        stale = store.counts(older_than=STALE_DEAD_LETTER_SECONDS)
        store.close()
        if stale:
            total = sum(stale.values())
            print(
                f"WARNING: {total} dead letter(s) older than "
                f"{STALE_DEAD_LETTER_SECONDS / 60:g} minutes in {store.path}:"
            )
            for (route, code), count in stale.items():
                print(f"  route {route}, {code}: {count}")
    return 0


def run(path: Path, rate: float, duration: float) -> int:
    """Drive the configured router from a synthetic producer while serving HTTP."""
    from taproute.service.host.loadgen import run_load

    counters = run_load(load_config(path), rate=rate, duration=duration)
    for route in counters.routes.values():
        print(
            f"route {route.name}: processed {route.processed:,}, emitted {route.emitted:,}, "
            f"failed {route.failed:,}"
        )
    return 0 if counters.failure is None else 1


def trace(path: Path, hook: str, fields: dict[str, int]) -> int:
    """Print where a record of ``hook`` would go, and why (a dry run)."""
    config = load_config(path)
    sink, runtime_kwargs = config.build()
    if runtime_kwargs["dead_letters"] is not None:
        runtime_kwargs["dead_letters"].close()
    result = sink.trace(hook, **fields)
    print(f"trace {hook} {' '.join(f'{k}={v}' for k, v in fields.items())}".rstrip())
    for verdict in result.verdicts:
        reason = f"  ({verdict.reason})" if verdict.reason else ""
        print(f"  {verdict.route:<20} {verdict.verdict:<12} -> {verdict.destination}{reason}")
    target = "dropped" if result.dropped else ", ".join(result.destinations)
    print(f"  => {target}")
    return 0


def dead_letters(args: argparse.Namespace) -> int:
    """List, show, skip or reroute dead letters."""
    if args.url is not None and args.action in ("skip", "reroute"):
        return _remote_control(args.url, args.token, args.action, args.id)
    config = load_config(args.config)
    if args.action == "reroute":
        return _reroute_offline(config, args.id)
    path = config.dead_letter_path()
    if path is None:
        raise ConfigFileError(config.source, ["no dead-letter store: set [dead_letters] path"])
    store = DeadLetterStore(path)
    try:
        if args.action == "list":
            letters = store.list(
                route=args.route,
                code=args.code,
                older_than=args.older_than,
                state=None if args.state == "all" else args.state,
            )
            print(
                f"{'id':>6} {'route':<16} {'code':<16} {'hook':<28} {'key':>8} {'tries':>5}  error"
            )
            for d in letters:
                print(
                    f"{d.id:>6} {d.route:<16} {d.code:<16} {d.hook:<28} {d.key:>8} "
                    f"{d.attempts:>5}  {d.error.splitlines()[0][:80]}"
                )
            print(f"{len(letters)} dead letter(s)")
        elif args.action == "show":
            letter = store.get(args.id)
            for key, value in letter.summary().items():
                print(f"{key:>17}: {value}")
            print(f"{'payload':>17}: {len(letter.payload or b'')} bytes")
            if letter.traceback:
                print(letter.traceback)
        else:  # skip
            letter = store.skip(args.id)
            print(f"dead letter {letter.id} skipped")
    finally:
        store.close()
    return 0


def _reroute_offline(config: ServiceConfig, letter_id: int) -> int:
    """Reroute through a router built from the config (the service must not be running)."""
    from taproute.service.host.service import create_record_runtime

    sink, runtime_kwargs = config.build()
    runtime_kwargs["http"] = None
    store = runtime_kwargs["dead_letters"]
    if store is None:
        raise ConfigFileError(config.source, ["no dead-letter store: set [dead_letters] path"])
    try:
        with create_record_runtime(record_sink=sink, **runtime_kwargs) as runtime:
            letter = runtime.reroute(letter_id)
            runtime.flush()
    finally:
        store.close()
    print(f"dead letter {letter.id} rerouted")
    return 0


def _remote_control(url: str, token: str | None, action: str, letter_id: int) -> int:
    request = urllib.request.Request(
        f"{url.rstrip('/')}/dead-letters/{letter_id}/{action}",
        method="POST",
        headers={"Authorization": f"Bearer {token}"} if token else {},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            body = json.loads(response.read())
    except urllib.error.HTTPError as error:
        print(
            f"{action} refused ({error.code}): {json.loads(error.read())['error']}", file=sys.stderr
        )
        return 1
    print(f"dead letter {body['id']} {body['state']}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="taproute", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser(
        "demo", help="capture a real transformer's activations, route them into chDB, query"
    )
    demo_parser.add_argument("--sentences", type=int, default=320)
    demo_parser.add_argument("--data", type=Path, default=Path("taproute-data"))
    demo_parser.add_argument("--serve", action="store_true", help="keep /metrics up after")
    demo_parser.add_argument("--port", type=int, default=9464)

    check_parser = commands.add_parser(
        "check", help="validate a config, its destinations, and report old dead letters"
    )
    check_parser.add_argument("--config", type=Path, required=True)

    run_parser = commands.add_parser(
        "run", help="drive a configured router with synthetic records, serving HTTP"
    )
    run_parser.add_argument("--config", type=Path, required=True)
    run_parser.add_argument("--rate", type=float, default=10_000.0, help="records per second")
    run_parser.add_argument("--duration", type=float, default=10.0, help="seconds")

    trace_parser = commands.add_parser("trace", help="where would a record go, and why (dry run)")
    trace_parser.add_argument("--config", type=Path, required=True)
    trace_parser.add_argument("--hook", required=True)
    for field in ("key", "step", "seq", "timestamp_ns"):
        trace_parser.add_argument(f"--{field.replace('_', '-')}", dest=field, type=int)

    letters = commands.add_parser("dead-letters", help="list, show, skip or reroute dead letters")
    letters.add_argument("action", choices=["list", "show", "skip", "reroute"])
    letters.add_argument("id", type=int, nargs="?")
    letters.add_argument("--config", type=Path)
    letters.add_argument("--url", help="a running service (skip/reroute through its HTTP)")
    letters.add_argument("--token", help="the service's bearer token (with --url)")
    letters.add_argument("--route")
    letters.add_argument("--code")
    letters.add_argument("--older-than", type=float, help="seconds since the last failure")
    letters.add_argument("--state", default="dead", choices=["dead", "skipped", "rerouted", "all"])

    from taproute.service.replay import cli as replay_cli

    replay_cli.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``taproute`` command."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "dead-letters":
        if args.action != "list" and args.id is None:
            parser.error(f"dead-letters {args.action} needs a dead letter id")
        if args.url is None and args.config is None:
            parser.error("dead-letters needs --config (or --url for skip/reroute)")
    try:
        if args.command == "demo":
            return demo(args.sentences, args.data, args.serve, args.port)
        if args.command == "check":
            return check(args.config)
        if args.command == "run":
            return run(args.config, args.rate, args.duration)
        if args.command == "trace":
            fields = {
                name: getattr(args, name)
                for name in ("key", "step", "seq", "timestamp_ns")
                if getattr(args, name) is not None
            }
            return trace(args.config, args.hook, fields)
        if args.command == "replay":
            from taproute.service.replay import cli as replay_cli

            return replay_cli.main(args)
        return dead_letters(args)
    except TaprouteError as exc:
        print(exc, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
