"""Capture from PyTorch models: hooks, the capture context, the host buffer pool.

- :mod:`~taproute.service.capture.context`: which request each batch row is
  and which of its positions are real (``capture_context``, ``carry_context``);
- :mod:`~taproute.service.capture.extract`: from a module's output to the
  exact bytes of one record per sequence (select, token-major, cast checks);
- :mod:`~taproute.service.capture.binding`: the hooks (``bind_module(s)``),
  their failure policy and counters;
- :mod:`~taproute.service.capture.hook_binding`: a bound hook's handle, the
  runtime it captures into, why records are skipped or dropped;
- :mod:`~taproute.service.capture.decode`: one step per forward pass of a
  decode loop (``capture_decode``);
- :mod:`~taproute.service.capture.pool`: reusable (pinned) host buffers.

torch is imported lazily: importing this package does not import torch.
"""

from taproute.service.capture.binding import OnError, bind_module, bind_modules
from taproute.service.capture.context import (
    CaptureContext,
    capture_context,
    carry_context,
    current_context,
)
from taproute.service.capture.decode import DecodeSteps, capture_decode
from taproute.service.capture.errors import CaptureError, CaptureWarning, ContextMismatch
from taproute.service.capture.extract import Select
from taproute.service.capture.hook_binding import CaptureTarget, HookBinding
from taproute.service.capture.pool import HostBufferPool

__all__ = [
    "CaptureContext",
    "CaptureError",
    "CaptureTarget",
    "CaptureWarning",
    "ContextMismatch",
    "DecodeSteps",
    "HookBinding",
    "HostBufferPool",
    "OnError",
    "Select",
    "bind_module",
    "bind_modules",
    "capture_context",
    "capture_decode",
    "carry_context",
    "current_context",
]
