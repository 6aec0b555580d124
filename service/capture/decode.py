"""Capture through a decode loop: ``model.generate()`` with a KV cache.

:func:`capture_decode` sets the capture context for every forward pass the
model makes inside it: step 0 for the prefill, then 1, 2, ... for each
decode step, with the real positions of *this* pass taken from the
attention mask the loop passes in (its last ``input length`` columns: the
prompt's real tokens at step 0, the one new token per sequence after).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from taproute.service.capture.context import _CONTEXT, CaptureContext, build_context
from taproute.service.capture.errors import CaptureError

if TYPE_CHECKING:
    import torch


class DecodeSteps:
    """The steps :func:`capture_decode` has set so far (``steps``: forward passes seen)."""

    def __init__(self) -> None:
        self.steps = 0
        self.current: CaptureContext | None = None


@contextmanager
def capture_decode(model: torch.nn.Module, keys: Sequence[int]) -> Iterator[DecodeSteps]:
    """Capture every forward pass of ``model`` inside, one step each.

    ::

        with capture_decode(model, request_ids):
            model.generate(input_ids, attention_mask=mask, max_new_tokens=16)

    Each bound hook then submits one record per sequence per step, keyed by
    ``keys[i]``, with ``step`` 0 for the prefill and ``n`` for the n-th decode
    step.  Finished sequences that the loop keeps padding still produce
    records (their rows are still in the batch).  Without an
    ``attention_mask`` every position of each pass is real.
    """
    state = DecodeSteps()
    key_list = [int(k) for k in keys]

    def before(_module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        tokens = kwargs.get("input_ids", args[0] if args else None)
        if tokens is None:
            tokens = kwargs.get("inputs_embeds")
        if tokens is None:
            raise CaptureError(
                "capture_decode: the model was called without input_ids or inputs_embeds"
            )
        mask = kwargs.get("attention_mask")
        width = tokens.shape[1]
        # The mask covers the cache and this pass: its last `width` columns are this pass.
        mask = mask[:, -width:] if mask is not None and mask.dim() == 2 else None
        state.current = build_context(key_list, attention_mask=mask, step=state.steps)
        state.steps += 1
        _CONTEXT.set(state.current)

    outer = _CONTEXT.set(None)
    handle = model.register_forward_pre_hook(before, with_kwargs=True)
    try:
        yield state
    finally:
        handle.remove()
        _CONTEXT.reset(outer)


__all__ = ["DecodeSteps", "capture_decode"]
