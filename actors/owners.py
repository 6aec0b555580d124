"""Stateful routes: owner actors, each holding one key range of the route's state.

A key's records are processed by its one owner, in arrival order.  A failing
record holds the later records of its key (order is the promise) until it
succeeds or is given up; other keys flow.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import attrs
import numpy as np
import trio

from taproute.actors.attempt import Attempt, Keys, Outcome
from taproute.actors.counters import RouteCounters
from taproute.actors.keys import KeyAction, KeyControl, KeyState, KeyStates
from taproute.actors.mailbox import Mailbox
from taproute.actors.route_actor import RouteActor
from taproute.native import DESCRIPTOR_DTYPE, StateRegion, owner_of, partition_keys
from taproute.routing.batch import RecordBatch, RowBatch
from taproute.routing.errors import KeyOutOfRange, KeyTerminal
from taproute.routing.failures import FailureCode, logger
from taproute.routing.validation import check_rows

#: Per owner: key -> attempts waiting for it (the head is the failing one), and
#: the key controls (complete, cancel, reopen) that came after them, in order.
Held = dict[int, deque[Any]]


@attrs.frozen
class _RetryKey:
    key: int


class StatefulRoute(RouteActor):
    """``workers`` owner actors, each holding one contiguous key range of the
    route's K x N state; a key's records are processed by one owner, in order.
    A failing record holds the later records of its key until it succeeds or
    is given up; other keys flow."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        route = self.planned.route
        spec = self.planned.processor
        assert spec is not None and spec.key_range is not None and spec.slot is not None
        self.key_function = spec.key
        self.key_range = spec.key_range
        self.state = StateRegion(spec.key_range, spec.slot.shape, spec.slot.dtype, route.workers)
        self.owner_mailboxes: list[Mailbox[Any]] = [
            Mailbox(
                f"route {self.name} owner {j}",
                capacity_records=route.capacity,
                capacity_bytes=route.capacity_bytes,
            )
            for j in range(route.workers)
        ]
        self.mailboxes = list(self.owner_mailboxes)
        self.held: list[Held] = [{} for _ in range(route.workers)]
        self.keys = KeyStates(spec.key_range)
        self.counters.valid_slots = 0
        self.counters.open_keys = 0

    def snapshot(self) -> RouteCounters:
        # Counted here, not per batch: a scan of the K valid flags.
        self.counters.valid_slots = self.state.valid_slots
        self.counters.open_keys = self.keys.open_keys()
        try:
            now = trio.current_time()
        except RuntimeError:  # read outside the loop (after it stopped): no clock
            self.counters.oldest_open_key_age_s = None
        else:
            self.counters.oldest_open_key_age_s = self.keys.oldest_open_age(now)
        return super().snapshot()

    def _owner_of(self, key: int) -> int:
        return int(owner_of(key, self.key_range, len(self.owner_mailboxes)))

    # -- intake ----------------------------------------------------------------

    async def dispatch(self, batch: RecordBatch) -> None:
        await self.parked.wait_for_room()
        try:
            keys = self._keys(batch)
        except Exception as exc:
            await self._reject(Attempt(batch), FailureCode.POLICY_INVALID, exc)
            return
        per_owner, bad = partition_keys(keys, self.key_range, len(self.owner_mailboxes))
        if bad is not None:
            first = int(bad[0])
            await self._reject(
                Attempt(batch.select(bad), keys[bad]),
                FailureCode.POLICY_INVALID,
                KeyOutOfRange(
                    f"route {self.name!r}: key {int(keys[first])} of record {first} is outside "
                    f"[0, {self.key_range}); {len(bad)} record(s) not processed"
                ),
            )
        for owner, selection in enumerate(per_owner):
            if selection is None:
                continue
            part = batch if len(selection) == len(batch) else batch.select(selection)
            await self._enqueue(self.owner_mailboxes[owner], (part, keys[selection]), part)

    async def key_control(self, action: KeyAction, request_keys: Keys) -> None:
        """Send ``action`` for ``request_keys`` to their owners, behind the records
        queued so far (called under the sink's submit lock, so ordered with them).

        Request keys go through the route's key function (as the ``key`` field of
        a descriptor whose other fields are 0); keys outside the route's range
        are no key of this route and are ignored.
        """
        keys = self._route_keys(request_keys)
        if not len(keys):
            return
        # A cancel discards the keys' queued records, except those a complete
        # still in transit must finalize first (they belong to the ended key).
        discarding = np.zeros(len(keys), dtype=bool)
        if action is KeyAction.CANCEL:
            discarding = self.keys.completing[keys] == 0
            self.keys.cancelling[keys[discarding]] += 1
        elif action is KeyAction.COMPLETE:
            self.keys.completing[keys] += 1
        per_owner, _ = partition_keys(keys, self.key_range, len(self.owner_mailboxes))
        for owner, selection in enumerate(per_owner):
            if selection is None:
                continue
            self._in_flight.add()
            await self.owner_mailboxes[owner].send(
                KeyControl(action, keys[selection], discarding[selection]), records=0, nbytes=0
            )

    def _route_keys(self, request_keys: Keys) -> Keys:
        assert self.key_function is not None
        descriptors = np.zeros(len(request_keys), dtype=DESCRIPTOR_DTYPE)
        descriptors["key"] = request_keys
        keys = np.asarray(self.key_function(descriptors), dtype=np.int64).reshape(-1)
        return np.unique(keys[(keys >= 0) & (keys < self.key_range)])

    def _keys(self, batch: RecordBatch) -> Keys:
        assert self.key_function is not None
        keys = np.ascontiguousarray(self.key_function(batch.descriptors), dtype=np.int64)
        if keys.shape != (len(batch),):
            raise KeyOutOfRange(
                f"route {self.name!r}: key function returned shape {keys.shape}, "
                f"expected ({len(batch)},)"
            )
        return keys

    # -- owners ------------------------------------------------------------------

    async def run(self, nursery: trio.Nursery) -> None:
        for owner, mailbox in enumerate(self.owner_mailboxes):
            nursery.start_soon(self._owner, owner, mailbox)
        nursery.start_soon(self.parked.run, self._retry)

    async def _owner(self, owner: int, mailbox: Mailbox[Any]) -> None:
        held = self.held[owner]
        while True:
            try:
                message = await mailbox.receive()
            except trio.EndOfChannel:
                break
            if isinstance(message, (_RetryKey, KeyControl)):
                try:
                    if isinstance(message, KeyControl):
                        await self._key_control(held, message)
                    else:
                        await self._retry_key(held, message.key)
                except Exception as exc:
                    self._latch.latch(exc, route=self.name, where="stateful owner")
                finally:
                    self._in_flight.done()
                continue
            batch, keys = message
            try:
                await self._admit(held, Attempt(batch, keys))
            except Exception as exc:
                self._latch.latch(exc, route=self.name, where="stateful owner")
            finally:
                self._settle(batch)
        # Closing: what still waits behind a failing key is given up, in order.
        for key, queue in held.items():
            while queue:
                attempt = queue.popleft()
                if isinstance(attempt, KeyControl):  # what it waited for is given up
                    await self._apply(held, attempt, key, 0, queued=True)
                    continue
                if attempt.code is None:
                    attempt.failed(
                        FailureCode.POLICY_INVALID,
                        RuntimeError("shut down while waiting behind a failing record of its key"),
                        None,
                    )
                await self._give_up(attempt)
        held.clear()

    def _message_batch(self, message: Any) -> RecordBatch | None:
        if isinstance(message, _RetryKey):
            self._in_flight.done()
            return None
        batch: RecordBatch = message[0]
        return batch

    def abandon(self) -> None:
        super().abandon()
        for held in self.held:
            for queue in held.values():
                for attempt in queue:
                    if isinstance(attempt, Attempt):
                        self.parked.release(attempt)
            held.clear()

    async def _admit(self, held: Held, attempt: Attempt) -> None:
        """Screen out records of cancelled and ended keys; queue records of held
        keys behind them; process the rest."""
        assert attempt.keys is not None
        if held:
            # Held keys' records queue unscreened: what is ahead of them in the
            # queue (a complete, a reopen) decides, when they come up.
            waiting = np.isin(attempt.keys, np.fromiter(held, dtype=np.int64))
            if waiting.any():
                for key in np.unique(attempt.keys[waiting]).tolist():
                    part = attempt.part(np.flatnonzero(attempt.keys == key))
                    self.parked.hold(part)
                    held[key].append(part)
                free = np.flatnonzero(~waiting)
                if not len(free):
                    return
                attempt = attempt.part(free)
        screened = await self._screen(attempt)
        if screened is not None:
            await self._process(screened)

    async def _screen(self, attempt: Attempt) -> Attempt | None:
        """Drop records of keys being cancelled (counted) and of ended keys
        (``_terminal``); note the rest's keys as open."""
        assert attempt.keys is not None
        cancelling, terminal = self.keys.screen(attempt.keys)
        ended = cancelling | terminal
        if ended.any():
            # Terminal first: a record after the key ended is terminal even while
            # another cancel of it is in transit.
            self.counters.cancelled_records += int(np.count_nonzero(cancelling & ~terminal))
            if terminal.any():
                await self._terminal(attempt.part(np.flatnonzero(terminal)))
            kept = np.flatnonzero(~ended)
            if not len(kept):
                return None
            attempt = attempt.part(kept)
        assert attempt.keys is not None
        self.keys.opened(attempt.keys, trio.current_time())
        return attempt

    # -- the failure path's stateful parts (the path itself is RouteActor's) -------

    async def _call(self, attempt: Attempt) -> Outcome:
        """One processor call; a failed call leaves no trace in the state.

        The slots of the batch's keys are saved before the call and put back
        if it fails, so a retry or the record-by-record re-run applies each
        record once.  (A call abandoned at its deadline may still write after
        that: its thread cannot be stopped.)
        """
        keys = attempt.keys
        assert keys is not None
        slots = self.state.slots
        touched = np.unique(keys)
        saved = slots[touched]  # fancy indexing: a copy
        outcome = await self._call_processor(attempt.batch, keys, self.state)
        if outcome.code is None:
            self.state.valid[keys] = True
        else:
            slots[touched] = saved
        return outcome

    def _units(self, attempt: Attempt) -> list[Attempt]:
        assert attempt.keys is not None
        keys = np.unique(attempt.keys).tolist()
        if len(keys) == 1:
            return [attempt]
        return [attempt.part(np.flatnonzero(attempt.keys == key)) for key in keys]

    def _held_queue(self, unit: Attempt) -> tuple[int, deque[Attempt]]:
        assert unit.keys is not None
        key = int(unit.keys[0])
        return key, self.held[self._owner_of(key)].setdefault(key, deque())

    def _park(self, unit: Attempt, due: float) -> None:
        key, queue = self._held_queue(unit)
        queue.appendleft(unit)
        self.parked.schedule(due, key)

    def _wait_behind(self, head: Attempt, rest: list[Attempt]) -> bool:
        _, queue = self._held_queue(head)
        for offset, attempt in enumerate(rest, start=1):
            self.parked.hold(attempt)
            queue.insert(offset, attempt)
        return True

    async def _retry(self, key: int) -> None:
        # Through the owner's mailbox, so the owner alone touches its held keys.
        # In flight until the owner has handled it, so a flush waits for it.
        self._in_flight.add()
        try:
            await self.owner_mailboxes[self._owner_of(key)].send(
                _RetryKey(key), records=0, nbytes=0
            )
        except trio.ClosedResourceError:
            self._in_flight.done()  # closing: the owner gives up what it holds

    async def _retry_key(self, held: Held, key: int) -> None:
        """Try a held key's head again, then the records that waited behind it."""
        queue = held.get(key)
        while queue:
            head = queue.popleft()
            if isinstance(head, KeyControl):
                await self._apply(held, head, key, 0, queued=True)
                continue
            head.scheduled = False
            self.parked.release(head)
            # Screened again: a complete, cancel or reopen ahead of it in the
            # queue may have changed its key's state since it arrived.
            screened = await self._screen(head)
            if screened is not None:
                await self._process(screened)
            if queue and isinstance(queue[0], Attempt) and queue[0].scheduled:
                return  # failed again: parked at the front with a new backoff
        held.pop(key, None)

    # -- key lifecycle (see keys.py) ---------------------------------------------

    async def _key_control(self, held: Held, control: KeyControl) -> None:
        """Apply a complete/cancel/reopen at its place in the owner's order: at
        once, or, for a key whose queue holds a pending complete, queued behind it."""
        for index, key in enumerate(control.keys.tolist()):
            queue = held.get(key)
            if queue and any(isinstance(x, KeyControl) for x in queue):
                queue.append(
                    KeyControl(
                        control.action,
                        control.keys[index : index + 1],
                        control.discarding[index : index + 1],
                    )
                )
                continue
            await self._apply(held, control, key, index, queued=False)

    async def _apply(
        self, held: Held, control: KeyControl, key: int, index: int, *, queued: bool
    ) -> None:
        """One key's control.  ``queued``: it came up in the key's held queue, so
        what is still queued behind it came after it."""
        state = self.keys.state
        if control.action is KeyAction.REOPEN:
            state[key] = KeyState.OPEN
        elif control.action is KeyAction.CANCEL:
            if control.discarding[index]:
                self.keys.cancelling[key] -= 1
            if state[key] != KeyState.OPEN:
                return  # ended already: nothing to cancel
            if not queued:
                for attempt in held.pop(key, ()):
                    if isinstance(attempt, Attempt):
                        self.counters.cancelled_records += len(attempt.batch)
                        self.parked.release(attempt)
            self.keys.clear(key, self.state, KeyState.CANCELLED)
            self.counters.cancelled_keys += 1
        elif state[key] != KeyState.OPEN:  # complete of an ended key: nothing to do
            self.keys.completing[key] -= 1
        elif held.get(key) and not queued:
            # After the key's waiting records, which it must not overtake.
            held[key].append(
                KeyControl(
                    control.action,
                    control.keys[index : index + 1],
                    control.discarding[index : index + 1],
                )
            )
        else:
            state[key] = KeyState.COMPLETED
            await self._finalize(key)

    async def _finalize(self, key: int) -> None:
        """Emit the key's final rows (if the processor has ``finalize`` and the key
        holds state), then clear its slot.  A failing finalize is counted and
        logged; the slot is cleared anyway (the key is over)."""
        spec = self.planned.processor
        layout = self.planned.output_layout
        if self.state.valid[key] and spec is not None and spec.finalize is not None:
            assert layout is not None
            try:
                async with self.limiter:
                    result = await trio.to_thread.run_sync(spec.finalize, self.state, key)
                rows = None
                if result is not None:
                    rows = check_rows(result, layout, route=self.name, processor=spec.name)
            except Exception as exc:
                self.counters.finalize_failures += 1
                logger.warning("route %r: finalize of key %d failed: %r", self.name, key, exc)
            else:
                if rows is not None and len(rows):
                    self.counters.finalize_rows += len(rows)
                    self.counters.emitted += len(rows)
                    await self.destination.deliver(
                        self.name, RowBatch(self.name, layout.name, rows)
                    )
        self.keys.clear(key, self.state, KeyState.COMPLETED)
        self.keys.completing[key] -= 1
        self.counters.completed_keys += 1

    async def _terminal(self, attempt: Attempt) -> None:
        """Records for an ended key: counted, then dropped or dead-lettered by policy."""
        self.counters.terminal_records += len(attempt.batch)
        if self.policy.terminal_records == "dead_letter":
            assert attempt.keys is not None
            await self._reject(
                attempt,
                FailureCode.KEY_TERMINAL,
                KeyTerminal(
                    f"route {self.name!r}: key {int(attempt.keys[0])} was completed or "
                    f"cancelled; reopen(key) to reuse it"
                ),
            )
