"""``taproute check``: a config file, its destinations, and what waits too long
(old dead letters, old spools, keys left open on a running service)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

from taproute.service.host.cli.errors import CommandError
from taproute.service.host.config import ServiceConfig, load_config

#: Dead letters older than this are reported by ``taproute check``.
STALE_DEAD_LETTER_SECONDS = 600.0

#: Keys open longer than this on a running service are reported by ``taproute check --url``.
OPEN_KEY_SECONDS = 600.0


def check(path: Path, url: str | None = None, open_key_age: float = OPEN_KEY_SECONDS) -> int:
    """Validate a config file and every destination's tables; warn about old dead
    letters and, with ``url`` (a running service), keys open past ``open_key_age``."""
    config = load_config(path)
    with config.build() as built:
        lines = config.check_destinations(running=url is not None)
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
        warn_open_keys(url, open_key_age)
    return 0


def stale_spools(config: ServiceConfig, older_than: float) -> list[str]:
    """A warning per destination whose spool holds a batch older than ``older_than`` s."""
    import time

    from taproute.service.sinks.spool.inspection import inspect

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


def warn_open_keys(url: str, threshold: float) -> None:
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
