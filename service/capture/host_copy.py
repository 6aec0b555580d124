"""From a captured tensor to host bytes a record batch can hold until released.

Two ways, chosen per call by where the tensor lives:

- **A device tensor** (CUDA) is copied into a buffer of the binding's
  :class:`~taproute.service.capture.pool.HostBufferPool` (page-locked, so the
  copy is non-blocking), and the current stream is synchronized before the
  bytes are handed on: a batch never holds a copy still in flight.  The
  batch's release gives the buffer back to the pool.  A CPU tensor takes
  the pool when it says so (``cpu_outputs=True``: the writer process's
  shared pool), gathered packed into a pooled buffer by the same native
  call, with no torch views on the model's thread.
- **A CPU tensor**: only the records' bytes (a row's real positions, not
  its padding) are copied, packed, into a fresh array from the process
  allocator, and its descriptors stamped, in one native call
  (:func:`~taproute.native.capture_records`).  Inside a forward pass that is much
  faster than a pooled buffer (``bench/profiles/hook_copy_*.txt``): the
  allocator hands back memory that was just in use, still in cache, where a
  pooled buffer was last written a wake-up interval ago.  A tensor the
  capture made itself (a cast to the layout's dtype, the gather of a mask's
  positions) is taken as it is when the records cover all of it.

Either way the result is the call's stamped descriptors, a read-only
``uint8`` array and a release callback (None: nothing to give back; the
array is freed with the batch).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from taproute.native import GiveBack, capture_records, stamped_copy
from taproute.routing.batch import Descriptors, Payload

if TYPE_CHECKING:
    import torch

    from taproute.service.capture.pool import HostBufferPool

Release = Callable[[], object] | None

#: What :func:`to_host` takes of a record plan: ``(token_shape, offsets,
#: lengths, covered, packed, in_source)`` (see :mod:`.plans`).
Plan = tuple[Any, npt.NDArray[np.int64], npt.NDArray[np.int64], int, Any, Any]


def to_host(
    source: torch.Tensor,
    pool: HostBufferPool,
    owned: bool,
    as_numpy: torch.dtype | None,
    plan: Plan,
    output_id: int,
    keys: npt.NDArray[np.int64],
    step: int,
) -> tuple[Descriptors, Payload, Release]:
    """One call's records on the host: their descriptors (stamped with
    ``output_id``, now, ``keys`` and ``step``), their bytes (a read-only
    ``uint8`` array) and the bytes' release.

    Record ``i`` is ``lengths[i]`` bytes at ``offsets[i]`` of ``source``'s
    bytes in C order (``covered`` in all; ``plan`` holds them and the two
    descriptor templates).  A CPU tensor's records are gathered back to back
    (the ``packed`` template) in one native call, into a pooled buffer when
    the pool takes CPU outputs, else into a fresh array; a device tensor is
    copied whole into a pooled buffer (the ``in_source`` template).
    ``owned``: ``source`` is a tensor the caller made and nobody else holds,
    taken as it is (no pool) when the records cover all of it.
    ``as_numpy``: the dtype to view ``source`` as before handing it to numpy
    (bfloat16, which numpy lacks, as int16; see :func:`numpy_view_dtype`).
    """
    _, offsets, lengths, covered, packed, in_source = plan
    if not source.is_cpu:
        payload, release = _pooled(source, pool)
        return stamped_copy(in_source, output_id, time.time_ns(), keys, step), payload, release
    if not source.is_contiguous() or source.is_neg():
        # A negated view (``.imag`` of a conjugated tensor) can be contiguous
        # while its memory holds the values un-negated: the bytes are read raw.
        source, owned = source.resolve_neg().contiguous(), True
    if pool.cpu_outputs:
        into = pool.take_host(covered)
        if into is not None:
            try:
                descriptors, payload = capture_records(
                    source.data_ptr(),
                    source.nbytes,
                    offsets,
                    lengths,
                    covered,
                    into,
                    packed,
                    output_id,
                    keys,
                    step,
                )
            except BaseException:
                pool.give_back(into)
                raise
            return descriptors, payload, GiveBack(pool, into)
    elif owned and covered == source.nbytes:
        # Records covering every byte of an array only we hold: it is the
        # packed payload already (plans list records in order, back to back).
        array = (source if as_numpy is None else source.view(as_numpy)).numpy()
        flat: Payload = array.reshape(-1).view(np.uint8)
        flat.flags.writeable = False
        return stamped_copy(packed, output_id, time.time_ns(), keys, step), flat, None
    # Straight from the tensor's memory (contiguous, alive while we copy): no
    # numpy views to build on the model's thread.
    descriptors, payload = capture_records(
        source.data_ptr(),
        source.nbytes,
        offsets,
        lengths,
        covered,
        None,
        packed,
        output_id,
        keys,
        step,
    )
    return descriptors, payload, None


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
