"""What can go wrong with a replay, one small class per way, each message
naming what was wrong and where (expected vs found)."""

from __future__ import annotations

import re

from taproute.routing.errors import ConfigError, TaprouteError

_PLAIN_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


class ReplayError(TaprouteError):
    """Base class of every replay error."""


class ReplayConfigError(ReplayError, ConfigError):
    """A replay is configured wrongly; raised before any work unit runs."""


class MissingSource(ReplayConfigError):
    """The corpus table or file does not exist, or holds no column the layout needs."""


class LayoutMismatch(ReplayConfigError):
    """The corpus's layout is not the one the processor reads."""


class MergeRequired(ReplayConfigError):
    """A stateful processor on several workers without a registered ``merge``/``finish``."""


class ConfigChanged(ReplayConfigError):
    """``resume`` of a run whose configuration hash differs from the ledger's."""


class UnknownRun(ReplayConfigError):
    """``resume`` names a run id that has no ledger."""


class RunInUse(ReplayConfigError):
    """Another replay (in this process or another) is running ``run_id`` now."""


class NotExactlyOnce(ReplayConfigError):
    """An existing output table has no deduplication window, so a resumed
    replay could write a unit twice."""


class UnitsFailed(ReplayError):
    """The run finished, but some work units failed past the retry budget."""

    def __init__(self, run_id: str, failed: dict[str, str], processor: str | None = None) -> None:
        self.run_id = run_id
        self.failed = failed
        self.processor = processor
        of = f" in processor {processor!r}" if processor else ""
        listing = "\n".join(f"  - {unit}: {error}" for unit, error in sorted(failed.items()))
        super().__init__(
            f"replay {run_id}: {len(failed)} work unit(s) failed{of} (the units that finished "
            f"are kept; resume with --resume {run_id} after fixing the cause):\n{listing}"
        )


class WorkerLost(ReplayError):
    """A worker process died (killed, crashed) while the run needed it."""


def plain_table(what: str, value: object) -> str:
    """``value`` if it is a plain table name (letters, digits, underscores, not
    starting with a digit), as the live sinks' tables are; it goes into the
    queries between backquotes, so a backquote would end it early."""
    if isinstance(value, str) and _PLAIN_NAME.match(value):
        return value
    raise ReplayConfigError(
        f"{what}: table name {value!r} must be letters, digits and underscores, "
        "not starting with a digit"
    )
