"""How a spool is kept: where, how big, how durable, what happens when full."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import attrs

from taproute.routing.errors import ConfigError

#: When appended frames are fsynced: at every ``flush()`` (default), also
#: every ``fsync_interval`` seconds while appending, or after every batch.
FsyncPolicy = Literal["flush", "interval", "batch"]
#: What an append does when the spool holds ``quota_bytes`` unacknowledged.
WhenFull = Literal["block", "drop_newest", "dead_letter"]

FSYNC_POLICIES: tuple[str, ...] = ("flush", "interval", "batch")
WHEN_FULL: tuple[str, ...] = ("block", "drop_newest", "dead_letter")


def _one_of(choices: tuple[str, ...]) -> Any:
    def check(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if value not in choices:
            raise ConfigError(
                f"spool {attribute.name}: expected one of {', '.join(choices)}, got {value!r}"
            )

    return check


def _positive(_: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not value > 0:
        raise ConfigError(f"spool {attribute.name}: must be > 0, got {value!r}")


@attrs.frozen(kw_only=True)
class SpoolConfig:
    """A spool's directory and policies.

    ``quota_bytes`` bounds the unacknowledged frames (header + batch bytes);
    the files on disk may exceed it by at most one segment (a segment is
    deleted once all its frames are delivered).  A single batch larger than
    the quota is still taken when the spool is empty, so nothing is refused
    only for being large.  ``block_timeout`` bounds how long ``block`` waits
    for room; past it the append raises :class:`~.spool.SpoolFull` (a
    spooling destination sheds the batch, counted).  None (default): the
    capture blocking budget where one exists (the runtime's ``max_block``,
    handed down when the runtime starts), else until there is room;
    ``math.inf``: until there is room, whatever the budget.
    """

    directory: Path = attrs.field(converter=Path)
    quota_bytes: int = attrs.field(default=1 << 30, validator=_positive)
    segment_bytes: int = attrs.field(default=64 << 20, validator=_positive)
    fsync: FsyncPolicy = attrs.field(default="flush", validator=_one_of(FSYNC_POLICIES))
    fsync_interval: float = attrs.field(default=1.0, validator=_positive)
    when_full: WhenFull = attrs.field(default="block", validator=_one_of(WHEN_FULL))
    block_timeout: float | None = None


__all__ = ["FSYNC_POLICIES", "WHEN_FULL", "FsyncPolicy", "SpoolConfig", "WhenFull"]
