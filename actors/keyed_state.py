"""A stateful route's keyed state and key lifecycle.

:class:`KeyedRoute` holds what the owner actors (``owners.py``) share: the
route's K x N state region split into contiguous key ranges, one mailbox and
one held-keys table per owner, and the per-key lifecycle flags.  It applies
complete, cancel and reopen to them (``keys.py`` says what each means); the
owners decide *when*, in their order.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import numpy as np
import trio

from taproute.actors.attempt import Attempt, Keys
from taproute.actors.counters import RouteCounters
from taproute.actors.keys import KeyAction, KeyControl, KeyState, KeyStates
from taproute.actors.mailbox import Mailbox
from taproute.actors.route_actor import RouteActor
from taproute.native import DESCRIPTOR_DTYPE, StateRegion, owner_of, partition_keys
from taproute.routing.batch import RowBatch
from taproute.routing.errors import KeyTerminal
from taproute.routing.failures import FailureCode, logger
from taproute.routing.validation import check_rows

#: Per owner: key -> attempts waiting for it (the head is the failing one), and
#: the key controls (complete, cancel, reopen) that came after them, in order.
Held = dict[int, deque[Any]]


class KeyedRoute(RouteActor):
    """The state and key lifecycle of a stateful route (its owner actors are
    :class:`~taproute.actors.owners.StatefulRoute`'s)."""

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
        #: Keys whose held records a reload handed over from the previous
        #: generation's route: retried first when this route starts.
        self.retry_first: list[int] = []
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
            self.keys.cancel_in_transit(keys[discarding])
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

    def mapped_keys(self, request_keys: Keys) -> tuple[Keys, dict[int, Exception]]:
        """This route's key of each request key (its key function applied to a
        descriptor whose other fields are 0), in range or not; and, by
        position, the error of the key function for each request key it
        raised on (an id it does not know): those map to -1, no key of this
        route.  One call for all of them; one per key only if that raised."""
        try:
            return self._key_function_of(request_keys), {}
        except Exception:
            pass
        keys = np.full(len(request_keys), -1, dtype=np.int64)
        errors: dict[int, Exception] = {}
        for index in range(len(request_keys)):
            try:
                keys[index] = self._key_function_of(request_keys[index : index + 1])[0]
            except Exception as exc:
                errors[index] = exc
        return keys, errors

    def _key_function_of(self, request_keys: Keys) -> Keys:
        assert self.key_function is not None
        descriptors = np.zeros(len(request_keys), dtype=DESCRIPTOR_DTYPE)
        descriptors["key"] = request_keys
        return np.asarray(self.key_function(descriptors), dtype=np.int64).reshape(-1)

    def _route_keys(self, request_keys: Keys) -> Keys:
        keys, _ = self.mapped_keys(request_keys)
        return np.unique(keys[(keys >= 0) & (keys < self.key_range)])

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
                        await self._discard(attempt)
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
        logged; the slot is cleared anyway (the key is over).

        ``finalize`` runs in a worker thread under the route's deadline, as the
        processor does: one that does not return within it is abandoned (its
        thread runs on, its result dropped) and counted as failed, so a hung
        finalize neither holds the owner's other keys nor a flush, and a
        shutdown whose grace runs out can cut it off."""
        spec = self.planned.processor
        layout = self.planned.output_layout
        if self.state.valid[key] and spec is not None and spec.finalize is not None:
            assert layout is not None
            deadline = self.policy.deadline or math.inf
            try:
                async with self.limiter:
                    with trio.move_on_after(deadline) as scope:
                        result = await trio.to_thread.run_sync(
                            spec.finalize,
                            self.state,
                            key,
                            limiter=self._threads,
                            abandon_on_cancel=True,
                        )
                if scope.cancelled_caught:
                    raise TimeoutError(f"no result within the route's {deadline:g} s deadline")
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
                    if self.chain is not None:
                        self.counters.derived += await self.chain.finalized(key, rows)
        self.keys.clear(key, self.state, KeyState.COMPLETED)
        self.keys.completing[key] -= 1
        self.counters.completed_keys += 1

    async def _terminal(self, attempt: Attempt) -> None:
        """Records for an ended key: counted, then dropped or dead-lettered by policy."""
        self.counters.terminal_records += len(attempt.batch)
        if self.policy.terminal_records != "dead_letter":
            await self._discard(attempt)
        else:
            assert attempt.keys is not None
            await self._reject(
                attempt,
                FailureCode.KEY_TERMINAL,
                KeyTerminal(
                    f"route {self.name!r}: key {int(attempt.keys[0])} was completed or "
                    f"cancelled; reopen(key) to reuse it"
                ),
            )
