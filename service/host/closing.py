"""The one ``with`` rule of the runtime and the service object."""

from __future__ import annotations

from types import TracebackType
from typing import Self


class ClosesOnExit:
    """``with obj:`` closes ``obj`` on the way out (within its shutdown grace:
    see :meth:`RecordRuntime.close <taproute.service.host.runtime.RecordRuntime.close>`).

    Leaving normally, a failure of ``close()`` (the first latched failure) is
    raised; leaving by an exception, that exception stands and a failing
    ``close()`` is not allowed to replace it: its failure is added to the
    exception as a note, so it is seen rather than lost.
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
            return
        try:
            self.close()
        except Exception as failure:  # already failing: the first error stands
            exc.add_note(
                f"while leaving the with block, closing the {type(self).__name__} "
                f"failed too: {type(failure).__name__}: {failure}"
            )
