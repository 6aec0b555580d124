"""Reusable host buffers that capture hooks copy device outputs into."""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class HostBufferPool:
    """Reusable host buffers by size; page-locked (pinned) when CUDA is in use.

    ``take`` returns a free buffer of at least ``nbytes`` (allocating one when
    none is free); ``give_back`` makes it reusable.  Thread-safe.

    Capture hooks copy device (CUDA) outputs into a pool's buffers.  CPU
    outputs get fresh arrays from the allocator instead (faster inside a
    forward pass: its memory is still in cache), unless ``cpu_outputs`` is
    set: then they are copied into this pool's buffers too.
    """

    def __init__(self, *, pin: bool | None = None, cpu_outputs: bool = False) -> None:
        import torch

        self.pin = torch.cuda.is_available() if pin is None else pin
        self.cpu_outputs = cpu_outputs
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._lock = threading.Lock()
        self.allocated = 0
        self.outstanding = 0

    @staticmethod
    def _size_class(nbytes: int) -> int:
        return 1 << max(12, (nbytes - 1).bit_length())  # powers of two from 4 KiB

    def take(self, nbytes: int) -> torch.Tensor:
        """A free buffer of at least ``nbytes`` (a uint8 tensor), now the caller's."""
        import torch

        size = self._size_class(nbytes)
        with self._lock:
            free = self._free[size]
            self.outstanding += 1
            if free:
                return free.pop()
            self.allocated += 1
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)

    def give_back(self, buffer: torch.Tensor) -> None:
        """Make ``buffer`` (from :meth:`take`) reusable."""
        with self._lock:
            self.outstanding -= 1
            self._free[buffer.numel()].append(buffer)
