"""``taproute dead-letters``: list, show, skip or reroute dead letters, from the
store file (offline) or through a running service's HTTP controls."""

from __future__ import annotations

import argparse
import json
import sqlite3
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import attrs

from taproute.service.host.cli.errors import BAD_INPUT, CommandError
from taproute.service.host.config import ConfigFileError, ServiceConfig, load_config
from taproute.service.ops.dead_letters import DeadLetterStore, DeadLetterStoreError


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
        return _remote_control(args.url, args.token, args.action, args.id, args.route)
    if args.action == "reroute":
        return _reroute_offline(load_config(args.config), args.id, args.route)
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
            print(outcome(letter.summary()))
    except sqlite3.Error as exc:  # a damaged file: say so, change nothing
        raise CommandError(f"{store.path}: unreadable store: {exc}", BAD_INPUT) from None
    finally:
        store.close()
    return 0


def outcome(letter: dict[str, Any]) -> str:
    """What a skip or reroute did, in one line (a reroute names the route and
    the copy's id, as the API's ``reroute_id`` and ``rerouted_to``)."""
    if letter["state"] == "rerouted":
        return (
            f"dead letter {letter['id']} rerouted to route {letter['rerouted_to']} "
            f"as copy {letter['reroute_id']}"
        )
    return f"dead letter {letter['id']} {letter['state']}"


def _reroute_offline(config: ServiceConfig, letter_id: int, route: str | None) -> int:
    """Reroute through a router built from the config (the service must not be
    running), to ``route`` or, without one, to the route that gave it up."""
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
        letter = service.reroute(letter_id, route)
        service.flush()
    print(outcome(letter.summary()))
    return 0


def _remote_control(
    url: str, token: str | None, action: str, letter_id: int | None, route: str | None
) -> int:
    if action not in ("skip", "reroute"):
        raise CommandError(f"--url works with skip and reroute, not {action}", BAD_INPUT)
    query = "" if route is None else "?" + urllib.parse.urlencode({"route": route})
    request = urllib.request.Request(
        f"{url.rstrip('/')}/dead-letters/{letter_id}/{action}{query}",
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
    print(outcome(body))
    return 0
