"""What the ingress queues besides batches: a :class:`Control` (flush, close,
key lifecycle, reload), ordered with the batches around it and answered
through its future once the record worker ran it at its place."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Literal

from taproute.routing.batch import RecordBatch
from taproute.routing.keys import KeyAction

#: A flush, a close, a key-lifecycle request (with its keys) or a reload;
#: ``deliver`` is a flush that waits for full delivery (``flush(wait=True)``).
ControlKind = Literal["flush", "deliver", "close", "reload"] | KeyAction


class Control:
    """A flush, close, key-lifecycle request (``keys``) or reload (``payload``:
    the prepared generation), ordered with the batches around it."""

    __slots__ = ("future", "keys", "kind", "payload")

    def __init__(
        self, kind: ControlKind, keys: tuple[int, ...] = (), payload: object = None
    ) -> None:
        self.kind = kind
        self.keys = keys
        self.payload = payload
        #: Done with None, or a flush's report.
        self.future: Future[Any] = Future()


Item = RecordBatch | Control


__all__ = ["Control", "ControlKind", "Item"]
