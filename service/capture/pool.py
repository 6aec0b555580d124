"""Reusable host buffers that capture hooks copy device outputs into."""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    import torch


class HostBufferPool:
    """Reusable host buffers by size; page-locked (pinned) when CUDA is in use.

    ``take`` returns a free buffer of at least ``nbytes`` (allocating one when
    none is free), a uint8 tensor; ``take_host`` the same as a uint8 numpy
    array (what a CPU output is gathered into natively); ``give_back`` makes
    either reusable.  Thread-safe.

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
        self._free_arrays: dict[int, list[npt.NDArray[np.uint8]]] = defaultdict(list)
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

    def take_host(self, nbytes: int) -> npt.NDArray[np.uint8]:
        """A free buffer of at least ``nbytes`` as a writable uint8 numpy array
        (over a tensor's memory, pinned like :meth:`take`'s), now the caller's."""
        import torch

        size = self._size_class(nbytes)
        with self._lock:
            free = self._free_arrays[size]
            self.outstanding += 1
            if free:
                return free.pop()
            self.allocated += 1
        array: npt.NDArray[np.uint8] = torch.empty(
            size, dtype=torch.uint8, pin_memory=self.pin
        ).numpy()  # holds its tensor
        return array

    def give_back(self, buffer: Any) -> None:
        """Make ``buffer`` (from :meth:`take` or :meth:`take_host`) reusable."""
        with self._lock:
            self.outstanding -= 1
            if type(buffer) is np.ndarray:
                self._free_arrays[buffer.nbytes].append(buffer)
            else:
                self._free[buffer.numel()].append(buffer)
