"""The one ``with`` rule of the runtime and the service object."""

from __future__ import annotations

from contextlib import suppress
from types import TracebackType
from typing import Self


class ClosesOnExit:
    """``with obj:`` closes ``obj`` on the way out.

    Leaving normally, a failure of ``close()`` (the first latched failure) is
    raised; leaving by an exception, that exception stands and a failing
    ``close()`` is not allowed to replace it.
    """

    def close(self, timeout: float | None = None) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.close()
        else:
            with suppress(Exception):  # already failing; the first error stands
                self.close()
