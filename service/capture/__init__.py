"""Capture from PyTorch models: hooks, the capture context, the host buffer pool.

torch is imported lazily: importing this package does not import torch.
"""

from taproute.service.capture.hooks import (
    CaptureContext,
    HookBinding,
    HostBufferPool,
    bind_module,
    bind_modules,
    capture_context,
)

__all__ = [
    "CaptureContext",
    "HookBinding",
    "HostBufferPool",
    "bind_module",
    "bind_modules",
    "capture_context",
]
