"""The ``taproute`` command: demo, check, run, trace, dead-letters, replay.

Exit codes: 0 done; 1 the work failed (a latched failure, a refused
control); 2 bad input (arguments, a config file, a missing or unreadable
dead-letter store).  Every error is printed as one line per problem on
stderr, never as a traceback.
"""

from __future__ import annotations

import argparse
import json
import socket
import sqlite3
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import attrs

from taproute.routing.errors import TaprouteError
from taproute.service.host.config import ConfigFileError, ServiceConfig, load_config
from taproute.service.host.http import HttpConfig
from taproute.service.ops.dead_letters import DeadLetterStore, DeadLetterStoreError

#: Dead letters older than this are reported by ``taproute check``.
STALE_DEAD_LETTER_SECONDS = 600.0

#: Keys open longer than this on a running service are reported by ``taproute check --url``.
OPEN_KEY_SECONDS = 600.0

#: Exit code of bad input (argparse's own).
BAD_INPUT = 2


class CommandError(TaprouteError):
    """A command cannot do what it was asked; ``code`` is its exit code."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def demo(sentences: int, data: Path, serve: bool, port: int) -> int:
    """Run all-MiniLM-L6-v2 with its captures routed into chDB (see taproute.service.demo)."""
    from taproute.service.demo import run as minilm_demo

    http = HttpConfig(port=port) if serve else None
    minilm_demo.run(data=data, count=sentences, http=http, serve_forever=serve)
    return 0


def check(path: Path, url: str | None = None, open_key_age: float = OPEN_KEY_SECONDS) -> int:
    """Validate a config file and every destination's tables; warn about old dead
    letters and, with ``url`` (a running service), keys open past ``open_key_age``."""
    config = load_config(path)
    with config.build() as built:
        lines = config.check_destinations()
        print(f"{path}: {len(config.routes)} route(s), {len(config.layouts)} layout(s) OK")
        for line in lines:
            print(f"  {line}")
        store = built.dead_letters
        if store is not None:
            stale = store.counts(older_than=STALE_DEAD_LETTER_SECONDS)
            if stale:
                total = sum(stale.values())
                print(
                    f"WARNING: {total} dead letter(s) older than "
                    f"{STALE_DEAD_LETTER_SECONDS / 60:g} minutes in {store.path}:"
                )
                for (route, code), count in stale.items():
                    print(f"  route {route}, {code}: {count}")
        for line in stale_spools(config, STALE_DEAD_LETTER_SECONDS):
            print(line)
    if url is not None:
        _warn_open_keys(url, open_key_age)
    return 0


def stale_spools(config: ServiceConfig, older_than: float) -> list[str]:
    """A warning per destination whose spool holds a batch older than ``older_than`` s."""
    import time

    from taproute.service.sinks.spool.log import inspect

    lines = []
    for name, dest in config.destinations.items():
        directory = dest.spool_directory(config.source.parent, name)
        if dest.spool == "off" or not directory.is_dir():
            continue
        held = inspect(directory)
        if held.oldest_written_ns is None:
            continue
        age = time.time() - held.oldest_written_ns / 1e9
        if age > older_than:
            lines.append(
                f"WARNING: destination {name!r}: spool {directory} holds {held.frames} "
                f"undelivered batch group(s), {held.bytes} bytes, the oldest "
                f"{age / 60:.0f} minutes old (older than {older_than / 60:g} minutes): "
                "is the destination down?"
            )
    return lines


def _warn_open_keys(url: str, threshold: float) -> None:
    """Warn about stateful routes of a running service whose oldest open key is
    older than ``threshold`` seconds (requests that were never completed)."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/status", timeout=30) as response:
            status = json.load(response)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise CommandError(f"{url}/status: cannot read the service's status: {exc}") from None
    for name, route in sorted(status.get("routes", {}).items()):
        age = route.get("oldest_open_key_age_s")
        if age is not None and age > threshold:
            print(
                f"WARNING: route {name}: {route.get('open_keys')} key(s) open, the oldest for "
                f"{age:,.0f} s (over {threshold:g} s): complete(key) or cancel(key) them"
            )


def run(path: Path, rate: float, duration: float, call_timeout: float | None = None) -> int:
    """Drive the configured router from a synthetic producer while serving HTTP."""
    from taproute.service.host.loadgen import run_load

    config = load_config(path)
    if call_timeout is not None:
        config = config.with_call_timeout(call_timeout)
    http = config.http if config.http is not None else HttpConfig()
    _check_listen(config, http)
    counters = run_load(config, rate=rate, duration=duration)
    for route in counters.routes.values():
        print(
            f"route {route.name}: processed {route.processed:,}, emitted {route.emitted:,}, "
            f"failed {route.failed:,}"
        )
    return 0 if counters.failure is None else 1


def _check_listen(config: ServiceConfig, http: HttpConfig) -> None:
    """Refuse an HTTP address that can't be listened on before anything starts."""
    if http.port == 0:
        return
    try:
        with socket.socket(socket.AF_INET6 if ":" in http.host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((http.host, http.port))
    except OSError as exc:
        where = "http.port" if config.http is not None else "http.port (default)"
        raise ConfigFileError(
            config.source,
            [f"{where}: cannot listen on {http.host}:{http.port}: {exc.strerror or exc}"],
        ) from None


def trace(path: Path, hook: str, fields: dict[str, int]) -> int:
    """Print where a record of ``hook`` would go, and why (a dry run)."""
    with load_config(path).build() as built:
        result = built.sink.trace(hook, **fields)
    print(f"trace {hook} {' '.join(f'{k}={v}' for k, v in fields.items())}".rstrip())
    for verdict in result.verdicts:
        reason = f"  ({verdict.reason})" if verdict.reason else ""
        print(f"  {verdict.route:<20} {verdict.verdict:<12} -> {verdict.destination}{reason}")
    target = "dropped" if result.dropped else ", ".join(result.destinations)
    print(f"  => {target}")
    return 0


def _existing_store(args: argparse.Namespace) -> DeadLetterStore:
    """The store ``--store`` or ``--config`` names; it must exist (never created here)."""
    if args.store is not None:
        path = args.store
    else:
        config = load_config(args.config)
        found = config.dead_letter_path()
        if found is None:
            raise ConfigFileError(config.source, ["dead_letters.path: no dead-letter store set"])
        path = found
    try:
        return DeadLetterStore(path, create=False)
    except DeadLetterStoreError as exc:
        raise CommandError(str(exc), BAD_INPUT) from None


def dead_letters(args: argparse.Namespace) -> int:
    """List, show, skip or reroute dead letters."""
    if args.url is not None:
        return _remote_control(args.url, args.token, args.action, args.id)
    if args.action == "reroute":
        return _reroute_offline(load_config(args.config), args.id)
    store = _existing_store(args)
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
    except sqlite3.Error as exc:  # a damaged file: say so, change nothing
        raise CommandError(f"{store.path}: unreadable store: {exc}", BAD_INPUT) from None
    finally:
        store.close()
    return 0


def _reroute_offline(config: ServiceConfig, letter_id: int) -> int:
    """Reroute through a router built from the config (the service must not be running)."""
    location = config.dead_letter_location()
    if location is None:
        raise ConfigFileError(config.source, ["dead_letters.path: no dead-letter store set"])
    try:  # refuse a missing or damaged store, or an unknown id, before building anything
        store = DeadLetterStore(location[0], create=False)
    except DeadLetterStoreError as exc:
        raise CommandError(str(exc), BAD_INPUT) from None
    try:
        store.get(letter_id)
    except sqlite3.Error as exc:
        raise CommandError(f"{store.path}: unreadable store: {exc}", BAD_INPUT) from None
    finally:
        store.close()
    with config.build() as built, attrs.evolve(built, http=None).start() as service:
        letter = service.reroute(letter_id)
        service.flush()
    print(f"dead letter {letter.id} rerouted")
    return 0


def _remote_control(url: str, token: str | None, action: str, letter_id: int | None) -> int:
    if action not in ("skip", "reroute"):
        raise CommandError(f"--url works with skip and reroute, not {action}", BAD_INPUT)
    request = urllib.request.Request(
        f"{url.rstrip('/')}/dead-letters/{letter_id}/{action}",
        method="POST",
        headers={"Authorization": f"Bearer {token}"} if token else {},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            body = json.loads(response.read())
    except urllib.error.HTTPError as error:
        try:
            reason = json.loads(error.read())["error"]
        except (ValueError, KeyError, TypeError):
            reason = error.reason
        raise CommandError(f"{action} refused ({error.code}): {reason}") from None
    except (urllib.error.URLError, OSError, ValueError) as error:
        reason = getattr(error, "reason", error)
        raise CommandError(f"cannot reach {url}: {reason}") from None
    print(f"dead letter {body['id']} {body['state']}")
    return 0


def _letter_id(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 1 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"dead letter ids are in [1, 2**63 - 1], got {text}")
    return value


def _int64(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not -(2**63) <= value < 2**63:
        raise argparse.ArgumentTypeError(f"must be a 64-bit integer, got {text}")
    return value


def _token(text: str) -> str:
    if not text or not text.isascii() or not text.isprintable() or " " in text:
        raise argparse.ArgumentTypeError("a token is printable ASCII without spaces")
    return text


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= value <= 86_400:
        raise argparse.ArgumentTypeError(f"must be in [0, 86400] seconds, got {text}")
    return value


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error on one line (``taproute dead-letters: error: ...``)."""

    def error(self, message: str) -> NoReturn:
        self.exit(BAD_INPUT, f"{self.prog}: error: {message} (see --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="taproute", description=__doc__)
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
    check_parser.add_argument(
        "--url", help="a running service: also warn about keys open past --open-key-age"
    )
    check_parser.add_argument(
        "--open-key-age",
        type=_seconds,
        default=OPEN_KEY_SECONDS,
        help=f"seconds a key may stay open before --url warns (default {OPEN_KEY_SECONDS:g})",
    )

    run_parser = commands.add_parser(
        "run", help="drive a configured router with synthetic records, serving HTTP"
    )
    run_parser.add_argument("--config", type=Path, required=True)
    run_parser.add_argument("--rate", type=float, default=10_000.0, help="records per second")
    run_parser.add_argument("--duration", type=float, default=10.0, help="seconds")
    run_parser.add_argument(
        "--call-timeout",
        type=_seconds,
        help="every route's processor deadline, in seconds (overrides the file's)",
    )

    trace_parser = commands.add_parser("trace", help="where would a record go, and why (dry run)")
    trace_parser.add_argument("--config", type=Path, required=True)
    trace_parser.add_argument("--hook", required=True)
    for field in ("key", "step", "seq", "timestamp_ns"):
        trace_parser.add_argument(f"--{field.replace('_', '-')}", dest=field, type=_int64)

    letters = commands.add_parser("dead-letters", help="list, show, skip or reroute dead letters")
    letters.add_argument("action", choices=["list", "show", "skip", "reroute"])
    letters.add_argument("id", type=_letter_id, nargs="?")
    letters.add_argument("--config", type=Path)
    letters.add_argument("--store", type=Path, help="a dead-letter store file (list/show/skip)")
    letters.add_argument("--url", help="a running service (skip/reroute through its HTTP)")
    letters.add_argument("--token", type=_token, help="the service's bearer token (with --url)")
    letters.add_argument("--route")
    letters.add_argument("--code")
    letters.add_argument("--older-than", type=float, help="seconds since the last failure")
    letters.add_argument("--state", default="dead", choices=["dead", "skipped", "rerouted", "all"])

    from taproute.service.replay import cli as replay_cli

    replay_cli.add_parser(commands)
    from taproute.service.signals import cli as signals_cli

    signals_cli.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``taproute`` command."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "dead-letters":
        if args.action != "list" and args.id is None:
            parser.error(f"dead-letters {args.action} needs a dead letter id")
        if args.url is None and args.config is None and args.store is None:
            parser.error("dead-letters needs --config or --store (or --url for skip/reroute)")
        if args.action == "reroute" and args.url is None and args.config is None:
            parser.error("dead-letters reroute needs --config (or --url)")
    try:
        return _dispatch(args)
    except ExceptionGroup as group:  # raised from a task of the service's loop
        found = _taproute_error(group)
        if found is None:
            raise
        return _report(found)
    except TaprouteError as exc:
        return _report(exc)


def _taproute_error(group: BaseExceptionGroup[BaseException]) -> TaprouteError | None:
    """The first of taproute's own errors in ``group`` (searched depth first)."""
    for exc in group.exceptions:
        if isinstance(exc, TaprouteError):
            return exc
        if isinstance(exc, BaseExceptionGroup):
            found = _taproute_error(exc)
            if found is not None:
                return found
    return None


def _report(exc: TaprouteError) -> int:
    """Print ``exc`` for an operator (one line per problem); return the exit code."""
    if isinstance(exc, ConfigFileError):
        print(exc, file=sys.stderr)
        return BAD_INPUT
    if isinstance(exc, CommandError):
        print(f"taproute: {exc}", file=sys.stderr)
        return exc.code
    print(f"taproute: {type(exc).__name__}: {exc}", file=sys.stderr)
    return 1


def _dispatch(args: argparse.Namespace) -> int:
    """Run the command ``args`` name."""
    if args.command == "demo":
        return demo(args.sentences, args.data, args.serve, args.port)
    if args.command == "check":
        return check(args.config, args.url, args.open_key_age)
    if args.command == "run":
        return run(args.config, args.rate, args.duration, args.call_timeout)
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
    if args.command == "report":
        from taproute.service.signals import cli as signals_cli

        return signals_cli.main(args)
    return dead_letters(args)


if __name__ == "__main__":
    sys.exit(main())
