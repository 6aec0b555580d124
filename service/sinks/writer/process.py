"""One writer process, seen from the model process: start it, talk to it,
stop it, and say how it ended.

The writer runs ``python -m taproute.service.sinks.writer.child`` (the same
interpreter, not a ``multiprocessing`` fork: forking a process that runs
torch and Trio threads is unsafe, and ``spawn`` would re-import the user's
``__main__``).  It gets its two sockets by inherited file descriptor, runs in
its own session (a Ctrl-C at the terminal reaches the model process, which
then closes the writer in order), and exits when told to or when its message
socket ends, so a model process that dies, even by SIGKILL, leaves no writer
behind.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys

import trio

from taproute.service.sinks.writer.errors import WriterDied, WriterStartError
from taproute.service.sinks.writer.protocol import (
    Close,
    MessageStream,
    Ready,
    StartFailed,
    WriterConfig,
    receive_blocking,
    send_blocking,
    send_segment,
)
from taproute.service.sinks.writer.shared_pool import SharedBufferPool


def describe_exit(code: int | None) -> str:
    """``exited with status 3`` / ``was killed by SIGKILL`` / ``is still running``."""
    if code is None:
        return "is still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with status {code}"


def _ended(process: subprocess.Popen[bytes], within: float = 5.0) -> int | None:
    """The exit code of a process whose socket just ended (it is exiting),
    or None if it still runs ``within`` seconds later."""
    try:
        return process.wait(within)
    except subprocess.TimeoutExpired:
        return None


def _not_ready(pid: int, config: WriterConfig, code: int, answered: str) -> WriterStartError:
    """A writer that ended before it was ready: killed by a signal, a death
    (:class:`WriterDied`, restarted like one); otherwise it cannot start."""
    kind = WriterDied if code < 0 else WriterStartError
    return kind(
        f"writer process {pid} for {config.where} {describe_exit(code)} before it was "
        f"ready{answered}"
    )


class WriterProcess:
    """A started writer process and the model process's ends of its sockets."""

    def __init__(
        self, process: subprocess.Popen[bytes], messages: socket.socket, segments: socket.socket
    ) -> None:
        self.process = process
        self.pid = process.pid
        self._messages = messages
        self._segments = segments
        self.stream: MessageStream | None = None
        self._segment_socket: trio.socket.SocketType | None = None
        #: Segments this process has been handed (each is sent once).
        self.segments_sent: set[int] = set()
        #: The hook table this process has last been sent.
        self.hooks_sent: object = None

    @classmethod
    def start(cls, config: WriterConfig, timeout: float) -> WriterProcess:
        """Start a writer for ``config`` and wait until its sink is built (blocking).

        Raises the writer's own error when building the sink failed (a
        ``SchemaMismatch``, a ``NoDeduplication``, ...), :class:`WriterStartError`
        when it exited or did not answer within ``timeout`` seconds.
        """
        messages, child_messages = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        segments, child_segments = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "taproute.service.sinks.writer.child",
                    str(child_messages.fileno()),
                    str(child_segments.fileno()),
                ],
                pass_fds=(child_messages.fileno(), child_segments.fileno()),
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        except BaseException:
            for sock in (messages, segments):
                sock.close()
            raise
        finally:
            child_messages.close()
            child_segments.close()
        started = cls(process, messages, segments)
        try:
            messages.settimeout(timeout)
            send_blocking(messages, config)
            reply = receive_blocking(messages)
            messages.settimeout(None)
        except BaseException as exc:
            # Its socket failed: it died (reset, broken pipe), or never answered.
            died = isinstance(exc, OSError) and not isinstance(exc, TimeoutError)
            ended = _ended(process) if died else None
            started.kill()
            started.close_sockets()
            if ended is not None:
                raise _not_ready(process.pid, config, ended, "") from exc
            if isinstance(exc, (TimeoutError, OSError)):
                raise WriterStartError(
                    f"writer process for {config.where} did not answer within {timeout} s: {exc}"
                ) from exc
            raise
        if isinstance(reply, Ready):
            return started
        ended = None if isinstance(reply, StartFailed) else _ended(process)
        code = started.kill()
        started.close_sockets()
        if isinstance(reply, StartFailed):
            raise reply.error
        raise _not_ready(process.pid, config, code if ended is None else ended, f" ({reply!r})")

    # -- the Trio side ------------------------------------------------------------

    def attach(self) -> MessageStream:
        """The message stream on the current Trio loop (made once)."""
        if self.stream is None:
            self.stream = MessageStream(self._messages)
            self._segment_socket = trio.socket.from_stdlib_socket(self._segments)
        return self.stream

    async def hand_segment(self, pool: SharedBufferPool, segment: int) -> None:
        """Send segment ``segment``'s descriptor, unless this process has it."""
        if segment in self.segments_sent:
            return
        assert self._segment_socket is not None, "attach() first"
        fd, size = pool.segment_fd(segment)
        await send_segment(self._segment_socket, segment, fd, size)
        self.segments_sent.add(segment)

    # -- blocking control -------------------------------------------------------------

    def request_blocking(self, message: object) -> object | None:
        """Send ``message`` and read the reply (only before the Trio side attached)."""
        if self.stream is not None:
            raise RuntimeError("the writer's socket is served by its Trio loop now")
        send_blocking(self._messages, message)
        return receive_blocking(self._messages)

    def send_close_blocking(self) -> None:
        """Ask the writer to exit (before the Trio side attached); ignores a dead one."""
        with contextlib.suppress(OSError):
            send_blocking(self._messages, Close())

    def stop(self, timeout: float) -> int:
        """Wait up to ``timeout`` seconds for an exit already asked for, then
        kill; the exit code (blocking; the sockets stay open)."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return self.kill()

    def kill(self) -> int:
        """SIGKILL the process unless it has exited, reap it; its exit code
        (negative: killed by that signal).  Blocking; the sockets stay open."""
        if self.process.poll() is None:
            self.process.kill()
        return self.process.wait()

    def close_sockets(self) -> None:
        """Close the sockets (when no Trio loop serves them)."""
        for sock in (self._messages, self._segments):
            with contextlib.suppress(OSError):
                sock.close()

    async def aclose(self) -> None:
        """Close the sockets through the Trio loop that serves them."""
        if self.stream is None:
            self.close_sockets()
            return
        await self.stream.aclose()
        if self._segment_socket is not None:
            self._segment_socket.close()
