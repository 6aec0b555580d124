"""Counting work in flight, so a flush can wait for the routes to drain."""

from __future__ import annotations

import trio


class InFlight:
    """How many batch messages are queued or being handled anywhere in a sink.

    Every send adds one; the actor that finishes handling a message removes
    one, *after* it has sent on whatever that message produced.  So when the
    count is zero, everything accepted so far has reached the destinations.
    """

    def __init__(self) -> None:
        self.count = 0
        self._idle = trio.Event()
        self._idle.set()

    def add(self) -> None:
        """One more message in flight."""
        if self.count == 0:
            self._idle = trio.Event()
        self.count += 1

    def done(self) -> None:
        """One message fully handled."""
        self.count -= 1
        if self.count == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Return once nothing is in flight."""
        await self._idle.wait()
