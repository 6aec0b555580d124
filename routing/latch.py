"""The first-failure latch: of a routing sink, a runtime, a destination.

A plain value (no Trio, no IO), so every layer that latches uses the same
one.  The first failure anywhere (a destination raising, an internal error) is
kept; later ones are counted where they happen but never replace it.  Every
later ``submit``/``flush``/``close`` raises the latched one.
"""

from __future__ import annotations

from taproute.routing.errors import RoutingFailure


class FailureLatch:
    """Holds the first :class:`RoutingFailure`; reading it is safe from any thread."""

    __slots__ = ("_failure",)

    def __init__(self) -> None:
        self._failure: RoutingFailure | None = None

    @property
    def failure(self) -> RoutingFailure | None:
        """The latched failure, or None while healthy."""
        return self._failure

    def latch(
        self,
        cause: BaseException,
        *,
        route: str | None = None,
        destination: str | None = None,
        where: str | None = None,
    ) -> RoutingFailure:
        """Latch ``cause`` unless something already is; return what is latched."""
        if self._failure is None:
            if isinstance(cause, RoutingFailure):
                self._failure = cause
            else:
                self._failure = RoutingFailure(
                    cause, route=route, destination=destination, where=where
                )
        return self._failure

    def raise_if_failed(self) -> None:
        """Raise the latched failure, if any."""
        if self._failure is not None:
            raise self._failure
