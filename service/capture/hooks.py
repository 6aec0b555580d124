"""Capture PyTorch module outputs as taproute records.

``bind_module(runtime, module, name, layout=...)`` registers a forward hook
that copies the module's output into a reusable host buffer (pinned on CUDA,
copied non-blocking, submitted once the copy is complete), and submits one
record per sequence of the batch under ``name``'s output_id.  The buffer
returns to its pool through the batch's release callback, after the last
route and destination are done with it.  Which request each row belongs to,
how many of its tokens are real, and the decode step come from the
:func:`capture_context` the server sets around its forward pass.

torch is imported lazily: the rest of taproute never needs it.
"""

from __future__ import annotations

import contextvars
import fnmatch
import threading
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from taproute.native import make_descriptors
from taproute.routing.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from taproute.service.host.runtime import RecordRuntime
    from taproute.service.host.service import RecordService


@attrs.frozen
class CaptureContext:
    """What the server knows about the forward pass in flight.

    ``keys[i]`` is the request id of batch row ``i``; ``lengths[i]`` how many
    of its positions are real tokens (padding is not captured); ``step`` the
    decode step.
    """

    keys: tuple[int, ...]
    lengths: tuple[int, ...] | None = None
    step: int = 0


_CONTEXT: contextvars.ContextVar[CaptureContext | None] = contextvars.ContextVar(
    "taproute_capture_context", default=None
)


@contextmanager
def capture_context(
    keys: Sequence[int], *, lengths: Sequence[int] | None = None, step: int = 0
) -> Iterator[CaptureContext]:
    """Set the request ids (and real lengths, step) of the forward pass inside."""
    context = CaptureContext(
        tuple(int(k) for k in keys),
        None if lengths is None else tuple(int(n) for n in lengths),
        step,
    )
    token = _CONTEXT.set(context)
    try:
        yield context
    finally:
        _CONTEXT.reset(token)


class HostBufferPool:
    """Reusable host buffers by size; page-locked (pinned) when CUDA is in use.

    ``take`` returns a free buffer of at least ``nbytes`` (allocating one when
    none is free); ``give_back`` makes it reusable.  Thread-safe.
    """

    def __init__(self, *, pin: bool | None = None) -> None:
        import torch

        self.pin = torch.cuda.is_available() if pin is None else pin
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._lock = threading.Lock()
        self.allocated = 0
        self.outstanding = 0

    @staticmethod
    def _size_class(nbytes: int) -> int:
        return 1 << max(12, (nbytes - 1).bit_length())  # powers of two from 4 KiB

    def take(self, nbytes: int) -> torch.Tensor:
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
        with self._lock:
            self.outstanding -= 1
            self._free[buffer.numel()].append(buffer)


class HookBinding:
    """A registered capture hook; :meth:`remove` unregisters it."""

    def __init__(self, name: str, output_id: int, handle: Any) -> None:
        self.name = name
        self.output_id = output_id
        self._handle = handle

    def remove(self) -> None:
        """Stop capturing (idempotent)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


def bind_module(
    runtime: RecordRuntime | RecordService,
    module: torch.nn.Module,
    name: str,
    *,
    layout: str,
    pool: HostBufferPool | None = None,
) -> HookBinding:
    """Capture ``module``'s output as records of ``layout`` under hook ``name``.

    The output must be a tensor (or a tuple whose first item is one) shaped
    ``(batch, tokens, ...)``; row ``i`` becomes one record keyed by the
    capture context's ``keys[i]``, holding its first ``lengths[i]`` tokens.
    Outside a capture context nothing is captured.
    """
    import torch

    if runtime.schema is None:
        raise ConfigError("bind_module needs a runtime with a schema (layouts to capture into)")
    layout_id = runtime.schema.layout_id(layout)
    tail = runtime.schema.by_id(layout_id).tail
    if tail is None or runtime.schema.by_id(layout_id).prefix_size:
        raise ConfigError(
            f"bind_module: layout {layout!r} must be a single variable-length Array column "
            "(captures vary in token count)"
        )
    element = tail.element_dtype
    torch_dtype = torch.from_numpy(np.empty(0, dtype=element)).dtype
    output_id = runtime.bind_hook(name, layout=layout)
    pool = pool or HostBufferPool()

    def hook(_module: torch.nn.Module, _inputs: Any, output: Any) -> None:
        context = _CONTEXT.get()
        if context is None:
            return
        tensor = output[0] if isinstance(output, tuple) else output
        tensor = tensor.detach()
        if tensor.dtype != torch_dtype:
            tensor = tensor.to(torch_dtype)
        rows = tensor.shape[0]
        if rows != len(context.keys):
            raise ConfigError(
                f"hook {name!r}: output has {rows} rows but the capture context has "
                f"{len(context.keys)} keys"
            )
        nbytes = tensor.numel() * tensor.element_size()
        buffer = pool.take(nbytes)
        host = buffer[:nbytes].view(torch_dtype).view(tensor.shape)
        host.copy_(tensor, non_blocking=tensor.is_cuda)
        if tensor.is_cuda:
            torch.cuda.current_stream(tensor.device).synchronize()  # the D2H copy is complete
        row_bytes = nbytes // rows if rows else 0
        per_token = row_bytes // tensor.shape[1] if tensor.dim() > 1 and tensor.shape[1] else 0
        lengths = (
            np.full(rows, row_bytes, dtype=np.int64)
            if context.lengths is None
            else np.asarray(context.lengths, dtype=np.int64) * per_token
        )
        descriptors = make_descriptors(
            output_id,
            lengths,
            offsets=np.arange(rows, dtype=np.int64) * row_bytes,
            layout_ids=layout_id,
            keys=np.asarray(context.keys, dtype=np.int64),
            steps=context.step,
        )
        try:
            runtime.submit_batch(
                descriptors, buffer.numpy()[:nbytes], release=lambda: pool.give_back(buffer)
            )
        except BaseException:
            pool.give_back(buffer)  # refused: the runtime never took it
            raise

    return HookBinding(name, output_id, module.register_forward_hook(hook))


def bind_modules(
    runtime: RecordRuntime | RecordService,
    model: torch.nn.Module,
    pattern: str,
    *,
    layout: str,
    prefix: str = "",
    pool: HostBufferPool | None = None,
) -> list[HookBinding]:
    """Bind every submodule whose qualified name matches ``pattern`` (a glob).

    Hook names are ``prefix + qualified name``; one buffer pool serves all.
    Raises if nothing matches.
    """
    pool = pool or HostBufferPool()
    bindings = [
        bind_module(runtime, module, prefix + qualified, layout=layout, pool=pool)
        for qualified, module in model.named_modules()
        if qualified and fnmatch.fnmatchcase(qualified, pattern)
    ]
    if not bindings:
        raise ConfigError(f"bind_modules: no submodule of the model matches {pattern!r}")
    return bindings
