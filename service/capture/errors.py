"""What capture reports when a model's output cannot be captured as bound."""

from __future__ import annotations

import warnings

from taproute.routing.errors import ConfigError


class CaptureError(ConfigError):
    """A capture that cannot give exact data: bad lengths or mask for the
    output, an output that is not a tensor, a lossy cast.  The message names
    the hook and what was expected and found."""


class ContextMismatch(CaptureError):
    """The capture context does not fit this call's output (keys, lengths, mask):
    this call's records are lost, the binding stays."""


class CaptureWarning(UserWarning):
    """Capture lost or skipped records (said once per hook and reason)."""


def warn_capture(message: str) -> None:
    """Issue a :class:`CaptureWarning` pointing at the caller's caller."""
    warnings.warn(message, CaptureWarning, stacklevel=3)
