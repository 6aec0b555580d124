"""What the model process and its writer process say to each other.

Two Unix socket pairs join them.  The *message* socket (a stream) carries
small pickled messages, each framed by its 8-byte length: descriptors,
segment references, commands and replies; never payload bytes.  The *segment*
socket (datagrams) carries a shared segment's file descriptor
(``SCM_RIGHTS``) with its id and size, once per segment per writer process,
sent before the first message that refers to it.

Both ends are written here: the blocking form (start-up handshake, a query
before the sink runs) and the Trio form (everything else).
"""

from __future__ import annotations

import array
import pickle
import socket
import struct
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import trio

_LENGTH = struct.Struct("<Q")
_SEGMENT = struct.Struct("<qq")
#: A message larger than this is a protocol error, not a block to wait for.
MAX_MESSAGE = 1 << 31


class ProtocolError(RuntimeError):
    """The other process sent something this one cannot read."""


# -- messages, model process -> writer ------------------------------------------


@attrs.frozen(kw_only=True)
class WriterConfig:
    """How the writer process builds its ClickHouse sink (picklable)."""

    kind: str  # "chdb" (``where`` is a directory) or "server" (``where`` is a URL)
    where: str
    schema: Any
    raw: tuple[str, ...] = ()
    rows: tuple[str, ...] = ()
    create_tables: bool = True
    raw_table: str = "raw_{layout}"
    rows_table: str = "{layout}"
    require_deduplication: bool = True
    inserts_in_flight: int = 2
    #: Added to the writer process's niceness (0 to 19): see ``WriterProcessSink``.
    nice: int = 0


@attrs.frozen
class RawItem:
    """A raw batch: its descriptors, and where its payload lies in shared memory."""

    segment: int
    offset: int
    length: int
    descriptors: npt.NDArray[np.void]


@attrs.frozen
class RowItem:
    """Processed rows (owned by the processor that made them; pickled whole)."""

    route: str
    layout_name: str
    rows: npt.NDArray[np.void]

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # numpy pickles a structured array with an object field (a String
        # column) row by row, about 3 us a row on the model process's GIL
        # (37% of the loop thread's GIL time in the example server,
        # bench/profiles/serve_load_gil_*.txt): send the other fields as
        # one buffer and each object field as a list instead.
        return (_row_item, (self.route, self.layout_name, *_split_objects(self.rows)))


def coalesce_rows(items: list[RawItem | RowItem]) -> list[RawItem | RowItem]:
    """``items`` with the rows of each (route, layout) joined into one
    :class:`RowItem`, at the place of its first (raw items unchanged, in
    order): one item's pickling overhead per route and block, not per
    processor call (a block holds every batch of a linger interval)."""
    groups: dict[tuple[str, str], list[RowItem]] = {}
    out: list[RawItem | RowItem | tuple[str, str]] = []
    for item in items:
        if isinstance(item, RowItem):
            key = (item.route, item.layout_name)
            if key not in groups:
                groups[key] = []
                out.append(key)
            groups[key].append(item)
        else:
            out.append(item)
    if all(len(group) == 1 for group in groups.values()):
        return items
    joined = {
        key: group[0]
        if len(group) == 1
        else RowItem(key[0], key[1], np.concatenate([g.rows for g in group]))
        for key, group in groups.items()
    }
    return [joined[x] if isinstance(x, tuple) else x for x in out]


def _split_objects(
    rows: npt.NDArray[np.void],
) -> tuple[npt.NDArray[np.void], np.dtype[np.void], dict[str, list[Any]]]:
    """``rows`` without its object fields, its dtype, and each object field as a list."""
    fields: dict[str, tuple[Any, ...]] = dict(rows.dtype.fields or {})
    objects = [name for name, (dtype, *_) in fields.items() if dtype.hasobject]
    if not objects:
        return rows, rows.dtype, {}
    plain = [name for name in fields if name not in objects]
    packed = np.empty(len(rows), dtype=[(name, fields[name][0]) for name in plain])
    for name in plain:
        packed[name] = rows[name]
    return packed, rows.dtype, {name: rows[name].tolist() for name in objects}


def _row_item(
    route: str,
    layout_name: str,
    packed: npt.NDArray[np.void],
    dtype: np.dtype[np.void],
    objects: dict[str, list[Any]],
) -> RowItem:
    """A :class:`RowItem` from :func:`_split_objects`'s parts."""
    if not objects:
        return RowItem(route, layout_name, packed)
    rows = np.empty(len(packed), dtype=dtype)
    for name in packed.dtype.names or ():
        rows[name] = packed[name]
    for name, values in objects.items():
        rows[name] = values
    return RowItem(route, layout_name, rows)


@attrs.frozen
class HookTable:
    """Every hook name bound so far (by output_id) and the token shapes said."""

    names: tuple[str, ...]
    shapes: dict[int, tuple[int, ...] | None]


@attrs.frozen
class Insert:
    """Insert these batches now, one block per table, tokens derived from ``token``."""

    block: int
    token: str
    items: list[RawItem | RowItem]
    hooks: HookTable | None


@attrs.frozen
class Query:
    """Run ``sql`` and answer with an Arrow IPC file."""

    query: int
    sql: str


@attrs.frozen
class Close:
    """Release the ClickHouse connection and exit."""


# -- messages, writer -> model process ------------------------------------------


@attrs.frozen
class Ready:
    """The sink is built and its tables checked."""

    pid: int


@attrs.frozen
class StartFailed:
    """Building the sink failed; ``error`` is the exception, pickled if it could be."""

    error: BaseException


@attrs.frozen
class Done:
    """Block ``block`` is persisted."""

    block: int


@attrs.frozen
class Failed:
    """Inserting block ``block`` failed; ``transient``: the same insert may succeed later."""

    block: int
    error: BaseException
    transient: bool


@attrs.frozen
class Answer:
    """The result of query ``query``: Arrow IPC file bytes, or the error."""

    query: int
    arrow: bytes | None
    error: BaseException | None


def portable_error(error: BaseException) -> BaseException:
    """``error`` itself when it survives pickling, else a RuntimeError with its text."""
    if type(error).__module__ == "__main__":  # would not unpickle in the other process
        return RuntimeError(f"{type(error).__name__}: {error}")
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error


# -- framing -----------------------------------------------------------------


def encode(message: object) -> bytes:
    body = pickle.dumps(message, protocol=5)
    return _LENGTH.pack(len(body)) + body


def send_blocking(sock: socket.socket, message: object) -> None:
    sock.sendall(encode(message))


def receive_blocking(sock: socket.socket) -> object | None:
    """The next message, or None at end of stream."""
    header = _read_exactly(sock, _LENGTH.size)
    if header is None:
        return None
    (length,) = _LENGTH.unpack(header)
    if length > MAX_MESSAGE:
        raise ProtocolError(f"message of {length} bytes announced; at most {MAX_MESSAGE}")
    body = _read_exactly(sock, length)
    if body is None:
        raise ProtocolError("stream ended inside a message")
    message: object = pickle.loads(body)
    return message


def _read_exactly(sock: socket.socket, length: int) -> bytes | None:
    parts, left = [], length
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            if left == length:
                return None
            raise ProtocolError("stream ended inside a message")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


class MessageStream:
    """The Trio side of the message socket: whole messages in, whole messages out."""

    def __init__(self, sock: socket.socket) -> None:
        self._stream = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
        self._buffer = bytearray()
        self._send_lock = trio.Lock()

    async def send(self, message: object) -> None:
        data = encode(message)
        async with self._send_lock:
            await self._stream.send_all(data)

    async def receive(self) -> object | None:
        """The next message, or None at end of stream (the other process is gone)."""
        while True:
            if len(self._buffer) >= _LENGTH.size:
                (length,) = _LENGTH.unpack_from(self._buffer)
                if length > MAX_MESSAGE:
                    raise ProtocolError(f"message of {length} bytes announced")
                end = _LENGTH.size + length
                if len(self._buffer) >= end:
                    body = bytes(self._buffer[_LENGTH.size : end])
                    del self._buffer[:end]
                    message: object = pickle.loads(body)
                    return message
            try:
                chunk = await self._stream.receive_some(1 << 20)
            except (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionResetError):
                chunk = b""
            if not chunk:
                if self._buffer:
                    raise ProtocolError("stream ended inside a message")
                return None
            self._buffer += chunk

    async def aclose(self) -> None:
        await self._stream.aclose()


# -- segment descriptors -------------------------------------------------------


async def send_segment(sock: trio.socket.SocketType, segment: int, fd: int, size: int) -> None:
    """Hand segment ``segment`` (its fd and size) to the writer process."""
    rights = array.array("i", [fd])
    await sock.sendmsg(
        [_SEGMENT.pack(segment, size)], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, rights)]
    )


async def receive_segment(sock: trio.socket.SocketType) -> tuple[int, int, int] | None:
    """The next segment handed over: ``(segment, fd, size)``, or None at the end."""
    data, fds = await _recv_fds(sock)
    if not data:
        return None
    if len(fds) != 1 or len(data) != _SEGMENT.size:
        raise ProtocolError(f"segment message of {len(data)} bytes with {len(fds)} descriptors")
    segment, size = _SEGMENT.unpack(data)
    return segment, fds[0], size


async def _recv_fds(sock: trio.socket.SocketType) -> tuple[bytes, list[int]]:
    data, ancillary, _flags, _address = await sock.recvmsg(
        _SEGMENT.size, socket.CMSG_SPACE(array.array("i").itemsize)
    )
    fds: list[int] = []
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            received = array.array("i")
            received.frombytes(payload[: len(payload) - (len(payload) % received.itemsize)])
            fds.extend(received)
    return data, fds
