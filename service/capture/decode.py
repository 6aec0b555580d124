"""Capture through a decode loop: ``model.generate()`` with a KV cache.

:func:`capture_decode` sets the capture context for every forward pass the
model makes inside it: step 0 for the prefill, then 1, 2, ... for each
decode step, with the real positions of *this* pass taken from the
attention mask the loop passes in (its last ``input length`` columns: the
prompt's real tokens at step 0, the one new token per sequence after; with
a static cache generate passes a 4-D mask of its own, whose query rows say
which tokens are real).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from taproute.service.capture.compiled import uncompiled
from taproute.service.capture.context import _CONTEXT, CaptureContext, _integers, build_context
from taproute.service.capture.errors import CaptureError

if TYPE_CHECKING:
    import torch


#: The innermost capture_decode block in effect here (a thread's own, or carried).
_DECODING: contextvars.ContextVar[DecodeSteps | None] = contextvars.ContextVar(
    "taproute_capture_decode", default=None
)


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
    ``attention_mask`` every position of each pass is real.  When generate
    expands each prompt into ``n`` rows (``num_beams``,
    ``num_return_sequences``: ``len(keys) * n`` rows, each prompt's ``n``
    next to each other), every row is keyed by its prompt's key, so a key
    gets ``n`` records per step.

    ``keys`` are checked here (integers, as :func:`capture_context` takes
    them).  Nothing raises into the model's forward pass: a pass whose rows
    do not fit the keys, or that has neither ``input_ids`` nor
    ``inputs_embeds``, gets a context of the keys alone, and its hooks drop
    what does not fit, counted (reason ``invalid_context``).
    """
    import torch

    if not isinstance(model, torch.nn.Module):
        raise CaptureError(
            f"capture_decode: model must be a torch.nn.Module, found {type(model).__name__}"
        )
    state = DecodeSteps()
    key_list = list(_integers("keys", keys, caller="capture_decode"))
    model = uncompiled(model)  # generate on a compiled model runs the model it wraps
    config = getattr(model, "config", None)
    encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
    get_encoder = getattr(model, "get_encoder", None) if encoder_decoder else None
    encoder: torch.nn.Module | None = get_encoder() if callable(get_encoder) else None
    passes: list[CaptureContext | None] = []  # the model's passes running now, innermost last

    def before(_module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # The hook is the model's, so it fires for every thread's passes: only
        # those run under this block (its thread, or carried) are its steps.
        if _DECODING.get() is not state:
            return
        # A forward pre-hook: whatever goes wrong here must not reach the model.
        step = state.steps
        state.steps += 1
        context = _safe_context(key_list, args, kwargs, step, decoder=encoder_decoder)
        state.current = context
        passes.append(context)
        _CONTEXT.set(context)

    def after(_module: torch.nn.Module, _args: Any, _kwargs: Any, _output: Any) -> None:
        if _DECODING.get() is state and passes:
            passes.pop()

    def before_encoder(
        _module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        # generate runs an encoder-decoder's encoder once, on its own, before
        # the first pass: its records are the prefill's (the step to come);
        # inside a pass (the model called directly) they are that pass's.
        if _DECODING.get() is not state:
            return
        step = state.steps - 1 if passes else state.steps
        context = _safe_context(key_list, args, kwargs, step, decoder=False)
        passes.append(_CONTEXT.get())
        _CONTEXT.set(context)

    def after_encoder(_module: torch.nn.Module, _args: Any, _kwargs: Any, _output: Any) -> None:
        if _DECODING.get() is state and passes:
            _CONTEXT.set(passes.pop())  # the decoder's context again, in a pass

    outer = _CONTEXT.set(None)
    decoding = _DECODING.set(state)
    # Under torch.compile the hooks run eagerly, as capture hooks do.
    eager: Callable[[Callable[..., None]], Callable[..., None]] = torch.compiler.disable
    handles = [
        model.register_forward_pre_hook(eager(before), with_kwargs=True),
        model.register_forward_hook(eager(after), with_kwargs=True, always_call=True),
    ]
    if encoder is not None:
        handles.append(encoder.register_forward_pre_hook(eager(before_encoder), with_kwargs=True))
        handles.append(
            encoder.register_forward_hook(eager(after_encoder), with_kwargs=True, always_call=True)
        )
    try:
        yield state
    finally:
        for handle in handles:
            handle.remove()
        _DECODING.reset(decoding)
        _CONTEXT.reset(outer)


def _safe_context(
    keys: list[int], args: tuple[Any, ...], kwargs: dict[str, Any], step: int, *, decoder: bool
) -> CaptureContext:
    """:func:`_pass_context`, or a context of the keys (and the pass's width)
    alone when it can't be made: its hooks then drop what does not fit them,
    counted, token-major ones included (their rows are keys x width)."""
    try:
        return _pass_context(keys, args, kwargs, step, decoder=decoder)
    except Exception:
        try:
            width = int(_tokens(args, kwargs, decoder=decoder).shape[1])
        except Exception:
            width = None
        return build_context(keys, step=step, positions=width)


def _tokens(args: tuple[Any, ...], kwargs: dict[str, Any], *, decoder: bool) -> Any:
    """The pass's token ids (or embeddings), ``(rows, width, ...)``, or None."""
    if decoder:
        tokens = kwargs.get("decoder_input_ids")
        return tokens if tokens is not None else kwargs.get("decoder_inputs_embeds")
    tokens = kwargs.get("input_ids", args[0] if args else None)
    return tokens if tokens is not None else kwargs.get("inputs_embeds")


def _pass_context(
    keys: list[int], args: tuple[Any, ...], kwargs: dict[str, Any], step: int, *, decoder: bool
) -> CaptureContext:
    """The context of one forward pass: its rows' keys, its real positions
    (``decoder``: an encoder-decoder's pass, whose hooks outside the encoder
    see the decoder's tokens)."""
    tokens = _tokens(args, kwargs, decoder=decoder)
    mask = kwargs.get("decoder_attention_mask" if decoder else "attention_mask")
    if tokens is None:
        raise CaptureError("capture_decode: a pass without input_ids or inputs_embeds")
    rows = tokens.shape[0]
    if keys and rows != len(keys) and rows % len(keys) == 0:
        # generate's expansion (beams, return sequences) repeats each prompt's row in place.
        keys = [key for key in keys for _ in range(rows // len(keys))]
    width = tokens.shape[1]
    if mask is not None and mask.dim() == 4:
        mask = _real_queries(mask)
    elif mask is not None and mask.dim() == 2:
        # The mask covers the cache and this pass: its last `width` columns are this pass.
        mask = mask[:, -width:]
    else:
        mask = None
    # The width too, for a pass without a mask: a token-major output's rows are checked by it.
    return build_context(keys, attention_mask=mask, step=step, positions=width)


def _real_queries(mask: torch.Tensor) -> torch.Tensor:
    """This pass's real positions, ``(batch, width)``, from the ``(batch, heads,
    width, cache)`` mask generate builds itself for a static cache: a real
    token attends to some key (itself at least), a padding one to none.  A
    boolean mask attends where True, an additive float mask (eager
    attention's) where 0.  Its last columns are the cache's unused end, not
    this pass: slicing them as a 2-D mask's would take padding as real."""
    attends = mask == 0 if mask.is_floating_point() else mask != 0
    return attends.any(dim=-1).any(dim=1)


__all__ = ["DecodeSteps", "capture_decode"]
