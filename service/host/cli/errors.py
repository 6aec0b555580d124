"""How the command fails: exit codes, its own error, one line per problem on stderr."""

from __future__ import annotations

import sys

from taproute.routing.errors import TaprouteError
from taproute.service.host.config import ConfigFileError

#: Exit code of bad input (argparse's own).
BAD_INPUT = 2


class CommandError(TaprouteError):
    """A command cannot do what it was asked; ``code`` is its exit code."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def taproute_error(group: BaseExceptionGroup[BaseException]) -> TaprouteError | None:
    """The first of taproute's own errors in ``group`` (searched depth first)."""
    for exc in group.exceptions:
        if isinstance(exc, TaprouteError):
            return exc
        if isinstance(exc, BaseExceptionGroup):
            found = taproute_error(exc)
            if found is not None:
                return found
    return None


def report(exc: TaprouteError) -> int:
    """Print ``exc`` for an operator (one line per problem); return the exit code."""
    if isinstance(exc, ConfigFileError):
        print(exc, file=sys.stderr)
        return BAD_INPUT
    if isinstance(exc, CommandError):
        print(f"taproute: {exc}", file=sys.stderr)
        return exc.code
    print(f"taproute: {type(exc).__name__}: {exc}", file=sys.stderr)
    return 1
