"""What can go wrong with a writer process, one small class each."""

from __future__ import annotations

from taproute.routing.errors import ConfigError, TaprouteError


class WriterStartError(TaprouteError, RuntimeError):
    """The writer process could not be started (it exited, or never answered)."""


class WriterDied(WriterStartError):
    """The writer process was killed by a signal before it was ready (an OOM
    kill, a SIGKILL): a death like any other, answered with a restart."""


class DirectoryInUse(ConfigError):
    """Another process has the chDB directory open (chDB allows one per directory)."""


class WriterCrashed(TaprouteError, RuntimeError):
    """The writer process died (and, when latched, was not restarted again)."""


class WriterInsertFailed(TaprouteError, RuntimeError):
    """An insert the writer process reported failed; ``transient``: may succeed later."""

    def __init__(self, message: str, *, transient: bool) -> None:
        super().__init__(message)
        self.transient = transient

    def __reduce__(self) -> tuple[object, ...]:
        return (_insert_failed, (str(self), self.transient))


def _insert_failed(message: str, transient: bool) -> WriterInsertFailed:
    return WriterInsertFailed(message, transient=transient)
