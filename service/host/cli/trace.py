"""``taproute trace``: where a record of a hook would go, and why (a dry run)."""

from __future__ import annotations

from pathlib import Path

from taproute.service.host.config import load_config


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
