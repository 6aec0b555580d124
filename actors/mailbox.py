"""Bounded mailboxes whose messages are batches.

A Trio memory channel carries the messages; capacity is counted in records
and in bytes, because one message is a whole batch.  A full mailbox makes
``send`` wait: that wait is the backpressure that reaches the producer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Generic, TypeVar

import trio

T = TypeVar("T")


class Mailbox(Generic[T]):
    """A bounded, closeable queue of batch messages for one actor (or a pool).

    A message larger than the whole capacity is still accepted once the
    mailbox is empty, so an oversize batch slows things down but never
    deadlocks.  Several receivers may share one mailbox (a worker pool).
    """

    def __init__(self, name: str, *, capacity_records: int, capacity_bytes: int) -> None:
        self.name = name
        self.capacity_records = capacity_records
        self.capacity_bytes = capacity_bytes
        #: Messages / records / bytes waiting now (sent and not yet received:
        #: a message handed straight to a waiting receiver counts until that
        #: receiver's ``receive`` returns).
        self.messages = 0
        self.records = 0
        self.bytes = 0
        self._closed = False
        self._send, self._receive = trio.open_memory_channel[tuple[T, int, int]](math.inf)
        self._space = trio.lowlevel.ParkingLot()
        #: A message taken from the channel by :meth:`receive_ready` and left
        #: first in line (still counted as waiting).
        self._front: tuple[T, int, int] | None = None

    def _fits(self, records: int, nbytes: int) -> bool:
        if self.records == 0:
            return True
        return (
            self.records + records <= self.capacity_records
            and self.bytes + nbytes <= self.capacity_bytes
        )

    async def send(self, message: T, *, records: int, nbytes: int, wait: bool = True) -> None:
        """Queue ``message``, waiting while the mailbox is full.

        ``wait=False`` queues it at once, over the capacity if need be: for a
        chain that comes back to its own route, which would otherwise wait on
        itself (what it carries is bounded by the causal limits instead).
        """
        if not wait or self._fits(records, nbytes):
            await trio.lowlevel.checkpoint_if_cancelled()
        else:
            while not self._fits(records, nbytes):
                await self._space.park()
        self._send.send_nowait((message, records, nbytes))
        self.messages += 1
        self.records += records
        self.bytes += nbytes

    async def receive(self) -> T:
        """The next message; raises ``trio.EndOfChannel`` once closed and drained.

        Takes a queued message without a trip through the scheduler; call
        :func:`trio.lowlevel.checkpoint` now and then in a loop that may never
        find the mailbox empty.
        """
        if self._front is not None:
            item, self._front = self._front, None
        else:
            try:
                item = self._receive.receive_nowait()
            except trio.WouldBlock:
                item = await self._receive.receive()
        message, records, nbytes = item
        self.messages -= 1
        self.records -= records
        self.bytes -= nbytes
        if self._space:
            self._space.unpark_all()
        return message

    def receive_ready(self, wanted: Callable[[T], bool]) -> tuple[T, int, int] | None:
        """The next message, if one is queued and ``wanted`` (else None, and it
        stays first in line), with its records and bytes, which stay counted
        as waiting (room for more is not made) until :meth:`done_with` them:
        an actor that takes several messages at once holds no more than the
        mailbox would."""
        if self._front is None:
            try:
                self._front = self._receive.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                return None
        if not wanted(self._front[0]):
            return None
        item, self._front = self._front, None
        self.messages -= 1
        return item

    def done_with(self, records: int, nbytes: int) -> None:
        """A message :meth:`receive_ready` returned is handled: its room is free."""
        self.records -= records
        self.bytes -= nbytes
        if self._space:
            self._space.unpark_all()

    @property
    def idle(self) -> bool:
        """True when no message waits and the mailbox is open: what its actor
        would be handed now is the only thing it would have to do."""
        return self.messages == 0 and not self._closed

    def close(self) -> None:
        """No more messages; receivers drain what is queued, then see EndOfChannel."""
        self._closed = True
        self._send.close()

    def take_all(self) -> list[T]:
        """Every message still queued, in order, without waiting (to settle them
        when the actors that would have handled them are gone)."""
        taken: list[T] = []
        if self._front is not None:
            (message, records, nbytes), self._front = self._front, None
            self.messages -= 1
            self.records -= records
            self.bytes -= nbytes
            taken.append(message)
        while True:
            try:
                message, records, nbytes = self._receive.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
            self.messages -= 1
            self.records -= records
            self.bytes -= nbytes
            taken.append(message)
        if self._space:
            self._space.unpark_all()
        return taken
