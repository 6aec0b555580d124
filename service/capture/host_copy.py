"""From a captured tensor to host bytes a record batch can hold until released.

Two ways, chosen per call by where the tensor lives:

- **A device tensor** (CUDA) is copied into a buffer of the binding's
  :class:`~taproute.service.capture.pool.HostBufferPool` (page-locked, so the
  copy is non-blocking), and the current stream is synchronized before the
  bytes are handed on: a batch never holds a copy still in flight.  The
  batch's release gives the buffer back to the pool.  A CPU tensor takes
  this path too when the pool says so (``cpu_outputs=True``).
- **A CPU tensor**: only the records' bytes (a row's real positions, not
  its padding) are copied, packed, into a fresh array from the process
  allocator, in one native call.  Inside a forward pass that is much
  faster than a pooled buffer (``bench/profiles/hook_copy_*.txt``): the
  allocator hands back memory that was just in use, still in cache, where a
  pooled buffer was last written a wake-up interval ago.  A tensor the
  capture made itself (a cast to the layout's dtype, the gather of a mask's
  positions) is taken as it is when the records cover all of it.

Either way the result is a read-only ``uint8`` array and a release callback
(None: nothing to give back; the array is freed with the batch).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from taproute.native import gather_address
from taproute.routing.batch import Payload

if TYPE_CHECKING:
    import torch

    from taproute.service.capture.pool import HostBufferPool

Release = Callable[[], object] | None


def to_host(
    source: torch.Tensor,
    pool: HostBufferPool,
    *,
    owned: bool,
    as_numpy: torch.dtype | None,
    offsets: npt.NDArray[np.int64],
    lengths: npt.NDArray[np.int64],
    covered: int,
) -> tuple[Payload, Release, bool]:
    """The records' bytes on the host (read-only ``uint8``) and their release.

    Record ``i`` is ``lengths[i]`` bytes at ``offsets[i]`` of ``source``'s
    bytes in C order (``covered`` in all).  The third value says where they
    are in the result: True, packed back to back in record order (the CPU
    path copies only those bytes); False, at the same offsets as in
    ``source`` (a pooled buffer holds all of ``source``).  ``owned``:
    ``source`` is a tensor the caller made and nobody else holds, taken as
    it is when the records cover all of it.  ``as_numpy``: the dtype to view
    ``source`` as before handing it to numpy (bfloat16, which numpy lacks, as
    int16; see :func:`numpy_view_dtype`).
    """
    if not source.is_cpu or pool.cpu_outputs:
        payload, release = _pooled(source, pool)
        return payload, release, False
    if not source.is_contiguous() or source.is_neg():
        # A negated view (``.imag`` of a conjugated tensor) can be contiguous
        # while its memory holds the values un-negated: the bytes are read raw.
        source, owned = source.resolve_neg().contiguous(), True
    nbytes = source.nbytes
    if owned and covered == nbytes:
        # Records covering every byte of an array only we hold: it is the
        # packed payload already (plans list records in order, back to back).
        array = (source if as_numpy is None else source.view(as_numpy)).numpy()
        flat: Payload = array.reshape(-1).view(np.uint8)
        flat.flags.writeable = False
        return flat, None, True
    # Straight from the tensor's memory (contiguous, alive while we copy): no
    # numpy views to build on the model's thread.
    return gather_address(source.data_ptr(), nbytes, offsets, lengths, covered), None, True


def numpy_view_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """What a tensor of ``dtype`` must be viewed as for ``.numpy()`` (None: itself)."""
    import torch

    return torch.int16 if dtype == torch.bfloat16 else None


def _pooled(source: torch.Tensor, pool: HostBufferPool) -> tuple[Payload, Release]:
    """Copy all of ``source`` into a pooled buffer; the copy is complete when this returns."""
    import torch

    nbytes = source.numel() * source.element_size()
    buffer = pool.take(nbytes)
    try:
        host = buffer[:nbytes].view(source.dtype).view(source.shape)
        host.copy_(source, non_blocking=source.is_cuda)
        if source.is_cuda:
            torch.cuda.current_stream(source.device).synchronize()  # the D2H copy is complete
    except BaseException:
        pool.give_back(buffer)
        raise
    flat: Payload = buffer.numpy()[:nbytes]
    flat.flags.writeable = False
    return flat, lambda: pool.give_back(buffer)
