"""Per-record failures: a processor raising, a bad output, a key out of range.

These are not the latched failure of a routing sink (that one stops it): the
route counts them, hands each to a failure handler and carries on.  The
default handler logs; the failure policy (retries, dead letters) plugs in
here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import attrs

from taproute.routing.batch import RecordBatch

logger = logging.getLogger("taproute.routing")


@attrs.frozen(eq=False)
class RecordFailure:
    """Records a route could not process, and why.

    ``records`` shares the original buffer: a handler that keeps it past the
    call must ``records.retain()``.
    """

    route: str
    processor: str | None
    error: BaseException
    records: RecordBatch

    @property
    def message(self) -> str:
        """One line: where, how many records, and the error."""
        proc = f", processor {self.processor!r}" if self.processor else ""
        return (
            f"route {self.route!r}{proc}: {len(self.records)} record(s) failed: "
            f"{type(self.error).__name__}: {self.error}"
        )


FailureHandler = Callable[[RecordFailure], None]


def log_failure(failure: RecordFailure) -> None:
    """The default handler: log a warning (the route's ``failed`` counter counts it)."""
    logger.warning("%s", failure.message)
