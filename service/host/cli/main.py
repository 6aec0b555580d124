"""The ``taproute`` command: demo, check (doctor), run, trace, dead-letters, replay, report.

Exit codes: 0 done; 1 the work failed (a latched failure, a refused
control); 2 bad input (arguments, a config file, a missing or unreadable
dead-letter store).  Every error is printed as one line per problem on
stderr, never as a traceback.
"""

from __future__ import annotations

import argparse
import os
import select
import sys
from collections.abc import Sequence
from pathlib import Path

from taproute.routing.errors import TaprouteError
from taproute.service.host.cli import arguments, check, dead_letters, errors, run, trace

#: Exit code after an interrupt (128 + SIGINT, as a shell reports it).
INTERRUPTED = 130


def _parser() -> argparse.ArgumentParser:
    parser = arguments.Parser(prog="taproute", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser(
        "demo", help="capture a real transformer's activations, route them into chDB, query"
    )
    demo_parser.add_argument(
        "--sentences", type=arguments.count, default=320, help="sentences to encode (default 320)"
    )
    demo_parser.add_argument(
        "--data",
        type=Path,
        default=Path("taproute-data"),
        help="chDB directory (default taproute-data)",
    )
    demo_parser.add_argument("--serve", action="store_true", help="keep /metrics up after")
    demo_parser.add_argument(
        "--port", type=arguments.port, default=9464, help="HTTP port with --serve (default 9464)"
    )

    # The issues and operators' habits call it "doctor"; one command, two names.
    check_parser = commands.add_parser(
        "check",
        aliases=["doctor"],
        help="validate a config, its destinations, and warn about old dead letters, "
        "old spools and keys open too long (alias: doctor)",
    )
    check_parser.add_argument("--config", type=Path, required=True)
    check_parser.add_argument(
        "--url", help="a running service: also warn about keys open past --open-key-age"
    )
    check_parser.add_argument(
        "--open-key-age",
        type=arguments.seconds,
        default=check.OPEN_KEY_SECONDS,
        help=f"seconds a key may stay open before --url warns (default {check.OPEN_KEY_SECONDS:g})",
    )

    run_parser = commands.add_parser(
        "run", help="drive a configured router with synthetic records, serving HTTP"
    )
    run_parser.add_argument("--config", type=Path, required=True)
    run_parser.add_argument(
        "--rate", type=arguments.rate, default=10_000.0, help="records per second"
    )
    run_parser.add_argument("--duration", type=arguments.seconds, default=10.0, help="seconds")
    run_parser.add_argument(
        "--call-timeout",
        type=arguments.seconds,
        help="every route's processor deadline, in seconds (overrides the file's; 0: none)",
    )

    trace_parser = commands.add_parser("trace", help="where would a record go, and why (dry run)")
    trace_target = trace_parser.add_mutually_exclusive_group(required=True)
    trace_target.add_argument("--config", type=Path)
    trace_target.add_argument("--url", help="a running service: trace with its routes and hooks")
    trace_parser.add_argument("--hook")
    trace_parser.add_argument(
        "--samples",
        action="store_true",
        help="trace each sample record the config's processors and predicates offer",
    )
    for field in ("key", "step", "seq", "timestamp_ns", "length"):
        trace_parser.add_argument(f"--{field.replace('_', '-')}", dest=field, type=arguments.int64)
    trace_parser.add_argument("--layout", help="the record's layout (default: the hook's)")

    letters = commands.add_parser("dead-letters", help="list, show, skip or reroute dead letters")
    letters.add_argument("action", choices=["list", "show", "skip", "reroute"])
    letters.add_argument("id", type=arguments.letter_id, nargs="?")
    letters.add_argument("--config", type=Path)
    letters.add_argument("--store", type=Path, help="a dead-letter store file (list/show/skip)")
    letters.add_argument("--url", help="a running service (skip/reroute through its HTTP)")
    letters.add_argument(
        "--token", type=arguments.token, help="the service's bearer token (with --url)"
    )
    letters.add_argument(
        "--route", help="list: only this route's letters; reroute: send the copy to this route"
    )
    letters.add_argument("--code")
    letters.add_argument(
        "--older-than", type=arguments.seconds, help="seconds since the last failure"
    )
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
        if args.route is not None and args.action in ("show", "skip"):
            parser.error(f"dead-letters {args.action} takes no --route (list and reroute do)")
        if args.action == "reroute" and args.url is None and args.config is None:
            parser.error("dead-letters reroute needs --config (or --url)")
    # What reads a chDB directory never makes one: chDB would create a mistyped
    # path, and the command would then fail on an empty store (exit 1).
    if args.command == "report" and args.url is None and not args.data.is_dir():
        parser.error(f"report --data {args.data}: no chDB directory there")
    if args.command == "replay" and args.chdb is not None and not args.chdb.is_dir():
        parser.error(f"replay --chdb {args.chdb}: no chDB directory there")
    if args.command == "trace":
        if args.samples and (args.url is not None or args.hook is not None):
            parser.error("trace --samples takes --config only (the samples are its routes')")
        if not args.samples and args.hook is None:
            parser.error("trace needs --hook (or --samples with --config)")
    try:
        return _dispatch(args)
    except BrokenPipeError:
        if not _stdout_closed():
            raise  # a connection's, not ours: not the reader leaving
        return _output_closed()
    except KeyboardInterrupt:
        # A second Ctrl-C, the escape hatch past the graceful stop: one line,
        # the shell's exit code of an interrupt, no traceback.
        print("taproute: interrupted (a second Ctrl-C): stopped without waiting", file=sys.stderr)
        return INTERRUPTED
    except ExceptionGroup as group:  # raised from a task of the service's loop
        found = errors.taproute_error(group)
        if found is None:
            raise
        return errors.report(found)
    except TaprouteError as exc:
        return errors.report(exc)


def _stdout_closed() -> bool:
    """Whether stdout is a pipe or socket whose reader has gone (poll says so
    without writing anything)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        events = poller.poll(0)
    except (OSError, ValueError, AttributeError):
        return False
    return any(mask & (select.POLLERR | select.POLLHUP) for _fd, mask in events)


def _output_closed() -> int:
    """The reader of stdout left (``taproute dead-letters list | head``): one
    line on stderr, exit 1, and stdout pointed at /dev/null so that Python's
    own flush at exit does not print a second error."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    print("taproute: output closed early (broken pipe)", file=sys.stderr)
    return 1


def _dispatch(args: argparse.Namespace) -> int:
    """Run the command ``args`` name."""
    if args.command == "demo":
        return run.demo(args.sentences, args.data, args.serve, args.port)
    if args.command in ("check", "doctor"):
        return check.check(args.config, args.url, args.open_key_age)
    if args.command == "run":
        return run.run(args.config, args.rate, args.duration, args.call_timeout)
    if args.command == "trace":
        fields = {
            name: getattr(args, name)
            for name in ("key", "step", "seq", "timestamp_ns", "length")
            if getattr(args, name) is not None
        }
        if args.samples:
            return trace.trace_samples(args.config)
        if args.url is not None:
            return trace.trace_remote(args.url, args.hook, fields, layout=args.layout)
        return trace.trace(args.config, args.hook, fields, layout=args.layout)
    if args.command == "replay":
        from taproute.service.host.config_destinations import chdb_holder
        from taproute.service.replay import cli as replay_cli

        # chDB refuses a second process on a directory with a bare traceback
        # ("Error initializing EmbeddedServer"): name the directory and holder.
        for flag, where in (("--chdb", args.chdb), ("--into", args.into)):
            if where is None or str(where).startswith(("http://", "https://")):
                continue
            holder = chdb_holder(Path(where))
            if holder is not None:
                raise errors.CommandError(
                    f"replay {flag} {where}: chDB directory in use by process {holder} "
                    "(chDB allows one process per directory)",
                    code=errors.BAD_INPUT,
                )
        return replay_cli.main(args)
    if args.command == "report":
        from taproute.service.signals import cli as signals_cli
        from taproute.service.signals.report import NoSignalTables

        try:
            return signals_cli.main(args)
        except NoSignalTables as exc:  # the store it names holds nothing to draw
            raise errors.CommandError(f"report: {exc}", code=errors.BAD_INPUT) from exc
    return dead_letters.dead_letters(args)
