"""What can go wrong with a replay, one small class per way, each message
naming what was wrong and where (expected vs found)."""

from __future__ import annotations

from taproute.routing.errors import ConfigError, TaprouteError


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


class NotExactlyOnce(ReplayConfigError):
    """An existing output table has no deduplication window, so a resumed
    replay could write a unit twice."""


class UnitsFailed(ReplayError):
    """The run finished, but some work units failed past the retry budget."""

    def __init__(self, run_id: str, failed: dict[str, str]) -> None:
        self.run_id = run_id
        self.failed = failed
        listing = "\n".join(f"  - {unit}: {error}" for unit, error in sorted(failed.items()))
        super().__init__(
            f"replay {run_id}: {len(failed)} work unit(s) failed (other units finished; "
            f"resume with --resume {run_id} after fixing the cause):\n{listing}"
        )


class WorkerLost(ReplayError):
    """A worker process died (killed, crashed) while the run needed it."""
