"""A call on a server that stopped answering is given up within the
server's ``connect_timeout``, not its ``send_receive_timeout``.

A server that takes the connection and never answers (hung, SIGSTOPped, a
half-dead proxy) holds a call for clickhouse-connect's read timeout,
``send_receive_timeout``: 300 s unless the URL sets it, and as long again
for every retry, so a flush without a spool took ``attempts x 300 s``
(40 minutes with the defaults) to give up, while the destination read
healthy.  A long insert into a busy server is no fault, so that timeout
cannot simply be shortened.

:func:`run_watched` asks instead: once a call has had no answer for
``connect_timeout`` seconds, it asks the server whether it is there at all
(``GET /ping``, given ``connect_timeout`` for everything, as when the sink
was built: see :mod:`.reach`), and again every ``connect_timeout`` while the
call runs.  A server that answers the ping is working on the call, which
goes on; one that does not is unreachable: the call is abandoned (it runs
on in its thread, within the transport's timeouts, its outcome dropped) and
fails with :class:`ServerSilent`, a transient connection error, so a
retried block keeps its deduplication token and a spooling owner takes it
over.  A hung server is thus known within twice ``connect_timeout``.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, runtime_checkable

import outcome
import trio

from taproute.service.sinks.clickhouse.reach import NotReached

T = TypeVar("T")


@runtime_checkable
class ChecksLiveness(Protocol):
    """A transport that can ask its server whether it is there, within a bound."""

    @property
    def liveness_timeout(self) -> float | None:
        """Seconds of silence before :meth:`check_alive` is asked (and its own
        bound); None: this transport cannot ask (chDB, a given client)."""
        ...

    def check_alive(self) -> None:
        """Return once the server answered; raise ``OSError`` if it did not
        within :attr:`liveness_timeout` (blocking)."""
        ...


class ServerSilent(NotReached):
    """A call that had no answer, from a server that then did not answer a
    ping either: the server is unreachable (transient; the call was
    abandoned)."""


class _Outcomes:
    """What the call's and the watchdog's threads handed back, and a wake-up
    for the task waiting on them (``deliver_*`` run in those threads and
    never raise)."""

    def __init__(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._changed = trio.Event()
        #: Set once the call returned, or its caller stopped waiting: the watchdog ends.
        self.over = threading.Event()
        self.call: outcome.Outcome[Any] | None = None
        self.silent: outcome.Outcome[ServerSilent | None] | None = None

    def deliver_call(self, result: outcome.Outcome[Any]) -> None:
        self.call = result
        self.over.set()
        self._wake()

    def deliver_silent(self, result: outcome.Outcome[ServerSilent | None]) -> None:
        self.silent = result
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(trio.RunFinishedError):  # abandoned, and the loop is gone
            self._token.run_sync_soon(self._changed.set)

    async def wait(self) -> None:
        await self._changed.wait()
        self._changed = trio.Event()


def _watchdog(watch: ChecksLiveness, timeout: float, over: threading.Event) -> ServerSilent | None:
    """In a thread: every ``timeout`` seconds while the call runs, ask the
    server; the first ping it does not answer ends the watch.  Real time
    (``threading``), not the Trio clock: a network timeout is real, and a
    test's virtual clock would ping at every jump."""
    started = time.monotonic()
    while not over.wait(timeout):
        try:
            watch.check_alive()
        except OSError as exc:
            silent = time.monotonic() - started
            return ServerSilent(
                f"no answer for {silent:.3g} s, and none to GET /ping either: {exc}"
            )
    return None


async def run_watched(
    watch: object, call: Callable[..., T], fn: Callable[..., object], *args: object
) -> T:
    """``call(fn, *args)`` in a worker thread (cancelling the caller abandons
    it), watched as the module docstring says when ``watch`` can check its
    server; raises :class:`ServerSilent` when the server stopped answering.

    No nursery: a cancel from outside (a flush that stops waiting, a
    shutdown's cut) reaches the caller as a plain ``trio.Cancelled``."""
    timeout = watch.liveness_timeout if isinstance(watch, ChecksLiveness) else None
    if timeout is None:
        return await trio.to_thread.run_sync(call, fn, *args, abandon_on_cancel=True)
    assert isinstance(watch, ChecksLiveness)
    done = _Outcomes()
    # start_thread_soon hands ``deliver_*`` the function's outcome (its value or error).
    trio.lowlevel.start_thread_soon(functools.partial(call, fn, *args), done.deliver_call)
    trio.lowlevel.start_thread_soon(
        functools.partial(_watchdog, watch, timeout, done.over), done.deliver_silent
    )
    try:
        while done.call is None:  # an answer wins over a silence found meanwhile
            if done.silent is not None:
                silent = done.silent.unwrap()  # a bug in the watchdog raises here
                if silent is not None:
                    raise silent  # the call is abandoned: it runs on in its thread
            await done.wait()  # cancelled from outside: the call is abandoned
    finally:
        done.over.set()  # no more pings for a call nobody waits for
    result: T = done.call.unwrap()
    return result


__all__ = ["ChecksLiveness", "ServerSilent", "run_watched"]
