"""Request keys as producers name them: the lifecycle actions on a key, and the
one check a key passes wherever it is given (the runtime, the routing sink).

What each action does to a stateful route's key is ``actors/keys.py``'s.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from taproute.native import check_int64


class KeyAction(enum.StrEnum):
    """What a lifecycle request asks of a key."""

    COMPLETE = "complete"
    CANCEL = "cancel"
    REOPEN = "reopen"


def request_keys(keys: Iterable[object]) -> tuple[int, ...]:
    """``keys`` as ints the descriptor's int64 ``key`` field holds, or raise
    :class:`~taproute.native.DescriptorFieldError` naming the bad one."""
    return tuple(check_int64("key", key) for key in keys)
