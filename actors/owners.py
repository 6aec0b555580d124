"""Stateful routes: owner actors, each holding one key range of the route's state.

A key's records are processed by its one owner, in arrival order.  A failing
record holds the later records of its key (order is the promise) until it
succeeds or is given up; other keys flow.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

import attrs
import numpy as np
import trio

from taproute.actors.attempt import Attempt, Keys, Outcome, runs_inline
from taproute.actors.keyed_state import Held, KeyedRoute
from taproute.actors.keys import KeyControl, distinct_keys
from taproute.actors.mailbox import Mailbox
from taproute.actors.one_hop import MAX_CALLS, Call, call_processor_in_one_hop
from taproute.actors.parking import restored_attempt
from taproute.actors.route_actor import RESTORING
from taproute.native import partition_keys
from taproute.native.state import SavedSlots
from taproute.routing.batch import RecordBatch
from taproute.routing.errors import KeyOutOfRange
from taproute.routing.failures import FailureCode
from taproute.routing.parking import Restored


@attrs.frozen
class _RetryKey:
    key: int


def _keys_of(attempt: Attempt) -> Keys:
    assert attempt.keys is not None
    return attempt.keys


def _is_new_batch(message: Any) -> bool:
    """A new batch's message (``(batch, keys)``), not a restored attempt or a control."""
    return isinstance(message, tuple)


class CallAbandoned(Exception):
    """A stateful call's thread got on after the call was given up: it does
    not call the processor."""


class _Rollback:
    """The save of the slots one processor call may touch (its keys'), made
    by calling it where the call runs, and put back by :meth:`undo`.

    A call given up (its deadline passed) before its thread finished the
    save never runs its processor: the save raises :class:`CallAbandoned`
    when the thread gets there, so records already given up (dead-lettered)
    are not applied to the state too.  A save given up midway leaves its
    buffer to the thread still writing it: the owner's next save copies into
    a new one."""

    __slots__ = ("_begun", "_keys", "_lock", "_route", "_undone", "saved")

    def __init__(self, route: StatefulRoute, keys: Keys) -> None:
        self._route = route
        self._keys = keys
        self._lock = threading.Lock()
        self._begun = False
        self._undone = False
        self.saved: SavedSlots | None = None

    def __call__(self) -> None:
        with self._lock:
            self._abandoned_check()
            self._begun = True
        route = self._route
        touched = distinct_keys(self._keys, route.key_range)
        owner = route._owner_of(int(touched[0])) if len(touched) else 0
        saved = route.state.save(touched, owner)
        with self._lock:
            self._abandoned_check()
            self.saved = saved

    def _abandoned_check(self) -> None:
        if self._undone:
            raise CallAbandoned(f"route {self._route.name!r}: call given up before it ran")

    def undo(self) -> None:
        """Put the saved slots back (the call failed).  Without a save there
        is nothing to put back (the call was given up before its save was
        done, or the save raised), and the buffer a save given up midway may
        still be writing is never reused."""
        with self._lock:
            self._undone = True
            saved, begun = self.saved, self._begun
        route = self._route
        if saved is not None:
            route.state.restore(saved)
        elif begun:
            route.state.drop_spare(route._owner_of(int(self._keys[0])) if len(self._keys) else 0)


class StatefulRoute(KeyedRoute):
    """``workers`` owner actors, each holding one contiguous key range of the
    route's K x N state; a key's records are processed by one owner, in order.
    A failing record holds the later records of its key until it succeeds or
    is given up; other keys flow."""

    # A backlog of an owner's batches goes to one worker thread together
    # (one_hop.py), which pays the hop once for up to MAX_CALLS calls; on the
    # loop each batch is a call of its own.  Judged by CPU time, a stateful
    # processor went to the loop under load and gave that up (the example
    # server's generate capacity fell by a tenth): its thread calls are
    # judged by wall time, as before THREAD_WAIT_S.
    thread_waits_by_cpu = False

    # -- intake ----------------------------------------------------------------

    async def dispatch(self, batch: RecordBatch, *, wait: bool = True) -> None:
        if wait:
            await self.parked.wait_for_room()
        self.counters.accepted += len(batch)
        tally = [0]  # records handed to an owner or settled here
        try:
            await self._partition(batch, tally, wait)
        except Exception as exc:
            self._cut_dispatch(len(batch), tally, exc)

    async def _partition(self, batch: RecordBatch, tally: list[int], wait: bool) -> None:
        """:meth:`dispatch`'s work: each key's records to its owner, bad keys
        given up; ``tally`` counts the records it took care of."""
        try:
            keys = self._keys(batch)
        except Exception as exc:
            await self._reject(Attempt(batch, tally=tally), FailureCode.POLICY_INVALID, exc)
            return
        per_owner, bad = partition_keys(keys, self.key_range, len(self.owner_mailboxes))
        if bad is not None:
            first = int(bad[0])
            await self._reject(
                Attempt(batch.select(bad), keys[bad], tally=tally),
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
            await self._enqueue(
                self.owner_mailboxes[owner], (part, keys[selection]), part, wait=wait
            )
            tally[0] += len(part)  # its owner's now: settled (or given up) there

    async def restore(self, restored: Restored, *, copy: bool = False) -> None:
        """Restored records go to their keys' owners like new ones, with their
        park ids and history (a key's records, restored in parked order, keep it)."""
        attempt = restored_attempt(restored)
        self.counters.accepted += len(attempt.batch)
        if not copy:
            self.counters.restored += len(attempt.batch)
        attempt.tally = tally = [0]  # records handed to an owner or settled here
        try:
            await self._restore_to_owners(attempt)
        except Exception as exc:
            self._cut_dispatch(len(attempt.batch), tally, exc, where=RESTORING)

    async def _restore_to_owners(self, attempt: Attempt) -> None:
        """:meth:`restore`'s work: each key's records to its owner, bad keys
        given up; ``attempt.tally`` counts the records it took care of."""
        tally = attempt.tally
        assert tally is not None
        try:
            keys = self._keys(attempt.batch)
        except Exception as exc:
            await self._reject(attempt, FailureCode.POLICY_INVALID, exc)
            return
        attempt.keys = keys
        per_owner, bad = partition_keys(keys, self.key_range, len(self.owner_mailboxes))
        if bad is not None:
            await self._reject(
                attempt.part(bad),
                FailureCode.POLICY_INVALID,
                KeyOutOfRange(f"route {self.name!r}: restored key outside [0, {self.key_range})"),
            )
        for owner, selection in enumerate(per_owner):
            if selection is not None:
                part = attempt if len(selection) == len(keys) else attempt.part(selection)
                await self._enqueue(self.owner_mailboxes[owner], part, part.batch)
                tally[0] += len(part.batch)  # its owner's now: settled there

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
        # Keys a reload handed over from the previous generation: retried at
        # once, ahead of whatever of theirs arrived since (it waits behind them).
        taken_over, self.retry_first = self.retry_first, []
        for key in taken_over:
            try:
                self.counters.retries += 1
                await self._retry(key)
            finally:
                self._in_flight.done()  # the handover's hold (see generation.py)

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
            if isinstance(message, Attempt):  # restored records
                attempt, batch = message, message.batch
            else:
                batch, keys = message
                attempt = Attempt(batch, keys)
                more = self._queued_with(held, mailbox)
                if more:
                    await self._admit_together(held, attempt, more, mailbox)
                    continue
            attempt.tally = tally = [0]
            try:
                await self._admit(held, attempt)
            except trio.Cancelled:  # a shutdown whose grace ran out: given up, counted
                self._count_cut(len(batch), tally)
                raise
            except Exception as exc:
                self._count_given_up(len(batch), tally)
                self._latch.latch(exc, route=self.name, where="stateful owner")
            finally:
                self._settle(batch)
        if self.handing_over:
            return  # retired by a reload: the sink hands `held` to the successor
        if self.parker.durable:
            # Closing: what waits stays in the park store, for the next start.
            for queue in held.values():
                for attempt in queue:
                    if isinstance(attempt, Attempt):
                        self.parked.release(attempt)
            held.clear()
            return
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
        if isinstance(message, (_RetryKey, KeyControl)):  # no batch; counted in flight
            self._in_flight.done()
            return None
        if isinstance(message, Attempt):
            return message.batch
        batch: RecordBatch = message[0]
        return batch

    def abandon(self) -> None:
        super().abandon()
        for held in self.held:
            for queue in held.values():
                for attempt in queue:
                    if isinstance(attempt, Attempt):
                        self._let_go_parked(attempt)
            held.clear()

    def _queued_with(self, held: Held, mailbox: Mailbox[Any]) -> list[tuple[Any, int, int]]:
        """New batches queued behind the one just received, to be processed
        with it in one thread hop (:mod:`one_hop`): none while a key of this
        owner is held, or where the processor runs on the loop or must run in
        a ``trio.to_thread`` thread."""
        spec = self.planned.processor
        if held or spec is None or spec.needs_thread or runs_inline(self.planned, self.placement):
            return []
        more: list[tuple[Any, int, int]] = []
        while len(more) < MAX_CALLS - 1:
            item = mailbox.receive_ready(_is_new_batch)
            if item is None:
                break
            more.append(item)
        return more

    async def _admit_together(
        self,
        held: Held,
        first: Attempt,
        more: list[tuple[Any, int, int]],
        mailbox: Mailbox[Any],
    ) -> None:
        """:meth:`_admit` of several new batches, in order, their calls made
        in one thread hop until one fails; those after it are admitted again
        one by one (behind its key, if it was held)."""
        tally = [0]  # shared: one count for the lot
        attempts = [first] + [Attempt(m[0], m[1], tally=tally) for m, _, _ in more]
        first.tally = tally
        try:
            screened = []
            for attempt in attempts:  # no key is held: screening is all _admit does first
                kept = await self._screen(attempt)
                if kept is not None:
                    screened.append(kept)
            made = 0
            if len(screened) > 1:
                rollbacks = [_Rollback(self, _keys_of(attempt)) for attempt in screened]
                outcomes = await call_processor_in_one_hop(
                    self.planned,
                    [
                        Call(attempt.batch, (attempt.keys, self.state), rollback)
                        for attempt, rollback in zip(screened, rollbacks, strict=True)
                    ],
                    limiter=self.limiter,
                    threads=self._threads,
                    hook_name=self._hook_name,
                    abandoned=self._abandoned_call,
                    placement=self.placement,
                )
                for attempt, rollback, outcome in zip(screened, rollbacks, outcomes, strict=False):
                    made += 1
                    if outcome.code is None:
                        self.state.valid[attempt.keys] = True
                    else:
                        rollback.undo()
                    await self._handle(attempt, outcome)
            for attempt in screened[made:]:
                if held:
                    await self._admit(held, attempt)  # screened again: its key may wait
                else:
                    await self._process(attempt)
        except trio.Cancelled:  # a shutdown whose grace ran out: what is unsettled, counted
            self._count_cut(sum(len(a.batch) for a in attempts), tally)
            raise
        except Exception as exc:
            self._count_given_up(sum(len(a.batch) for a in attempts), tally)
            self._latch.latch(exc, route=self.name, where="stateful owner")
        finally:
            self._settle(first.batch)
            for message, records, nbytes in more:
                self._settle(message[0])
                mailbox.done_with(records, nbytes)

    async def _admit(self, held: Held, attempt: Attempt) -> None:
        """Screen out records of cancelled and ended keys; queue records of held
        keys behind them; process the rest."""
        assert attempt.keys is not None
        if held:
            # Held keys' records queue unscreened: what is ahead of them in the
            # queue (a complete, a reopen) decides, when they come up.
            waiting = np.isin(attempt.keys, np.fromiter(held, dtype=np.int64))
            if waiting.any():
                for key in distinct_keys(attempt.keys[waiting], self.key_range).tolist():
                    part = attempt.part(np.flatnonzero(attempt.keys == key))
                    self.parked.hold(part)
                    held[key].append(part)
                    await self._keep(part, waiting_behind=key)
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
        screened = self.keys.screen(attempt.keys)
        if screened is not None and (ended := screened[0] | screened[1]).any():
            cancelling, terminal = screened
            # Terminal first: a record after the key ended is terminal even while
            # another cancel of it is in transit.
            cancelled = cancelling & ~terminal
            if cancelled.any():
                self.counters.cancelled_records += int(np.count_nonzero(cancelled))
                await self._discard(attempt.part(np.flatnonzero(cancelled)))
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

        The slots of the batch's keys are saved just before the call, in the
        thread that makes it (one hop carries both, and the copy reads slots
        that thread's core wrote last), and put back if it fails, so a retry
        or the record-by-record re-run applies each record once.  (A call
        abandoned at its deadline may still write after that: its thread
        cannot be stopped.)
        """
        keys = attempt.keys
        assert keys is not None
        rollback = _Rollback(self, keys)
        outcome = await self._call_processor(attempt.batch, keys, self.state, prepare=rollback)
        if outcome.code is None:
            self.state.valid[keys] = True
        else:
            rollback.undo()
        return outcome

    def _units(self, attempt: Attempt) -> list[Attempt]:
        assert attempt.keys is not None
        keys = distinct_keys(attempt.keys, self.key_range).tolist()
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

    async def _wait_behind(self, head: Attempt, rest: list[Attempt]) -> bool:
        key, queue = self._held_queue(head)
        for offset, attempt in enumerate(rest, start=1):
            self.parked.hold(attempt)
            queue.insert(offset, attempt)
            await self._keep(attempt, waiting_behind=key)
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
            # Its buffer is held while it runs: the park's hold may be the last
            # one (the message that brought it was settled when it was parked),
            # and letting that go first gave the buffer back to its producer
            # before the retry read it (LeaseError: the retry failed, latched).
            running = head.batch.retain()
            self.parked.release(head)
            # Accepted and not done while it runs, as a stateless retry's
            # message is: a shutdown's grace cuts the route off and names it.
            self.counters.backlog += len(head.batch)
            head.tally = tally = [0]
            try:
                # Screened again: a complete, cancel or reopen ahead of it in
                # the queue may have changed its key's state since it arrived.
                screened = await self._screen(head)
                if screened is not None:
                    await self._process(screened)
            except trio.Cancelled:  # a shutdown's grace ran out: no longer parked
                self._count_cut(len(head.batch), tally)
                raise
            except Exception:  # latched by the owner: no longer parked, counted here
                self._count_given_up(len(head.batch), tally)
                raise
            finally:
                self.counters.backlog -= len(head.batch)
                try:
                    running.release()
                except Exception as exc:
                    self._latch.latch(exc, route=self.name, where="buffer release callback")
            if queue and isinstance(queue[0], Attempt) and queue[0].scheduled:
                return  # failed again: parked at the front with a new backoff
        held.pop(key, None)
