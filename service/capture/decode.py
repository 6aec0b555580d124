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
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from taproute.service.capture.compiled import retrace_compiled, uncompiled
from taproute.service.capture.context import _CONTEXT, CaptureContext, _integers, build_context
from taproute.service.capture.errors import CaptureError
from taproute.service.capture.traced import Runner, as_tensor, capture_operator, register

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
        #: The model's hooks this block acts through, and what each does in
        #: this block: a pass begins, ends; the encoder begins, ends.
        self._hooks: _ModelHooks | None = None
        self._handlers: tuple[Callable[..., None], ...] = ()


class _ModelHooks:
    """A model's capture_decode hooks: registered at its first block, kept.

    Each acts for the block in effect where the pass runs (this thread's, or
    carried), when that block is on this model, and does nothing otherwise.
    Kept rather than registered per block because code torch.compile traced
    without them never calls hooks added later (Dynamo does not watch a
    module's hooks), so every block after a warm-up would see no pass.  The
    first block invalidates the code compiled so far (as bind_module does),
    once per model.  Under tracing each hook passes the pass's tokens and
    mask to the capture operator, whose kernel runs the block's handler
    (see traced.py): no graph break, so fullgraph compiles too.  Eagerly,
    outside any block, a hook costs a context variable read per pass.
    """

    def __init__(self, model: torch.nn.Module, encoder: torch.nn.Module | None) -> None:
        import torch

        decoder = bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))
        is_compiling = torch.compiler.is_compiling
        operator = capture_operator()

        def act(role: int, *values: Any) -> None:
            state = _DECODING.get()
            if state is not None and state._hooks is self:
                state._handlers[role](*values)

        def runner(role: int) -> Runner:
            return lambda tensors: act(role, *tensors)

        self._runners = tuple(runner(role) for role in range(4))  # registered weakly
        numbers = tuple(register(run) for run in self._runners)

        def before(_module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if is_compiling():
                tokens = as_tensor(_tokens(args, kwargs, decoder=decoder))
                operator([tokens, as_tensor(_mask(kwargs, decoder))], numbers[0])
                return
            state = _DECODING.get()
            if state is not None and state._hooks is self:
                state._handlers[0](_tokens(args, kwargs, decoder=decoder), _mask(kwargs, decoder))

        def after(_module: torch.nn.Module, _args: Any, _kwargs: Any, _output: Any) -> None:
            if is_compiling():
                operator([], numbers[1])
                return
            state = _DECODING.get()
            if state is not None and state._hooks is self:
                state._handlers[1]()

        def before_encoder(
            _module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> None:
            if is_compiling():
                tokens = as_tensor(_tokens(args, kwargs, decoder=False))
                operator([tokens, as_tensor(_mask(kwargs, False))], numbers[2])
                return
            state = _DECODING.get()
            if state is not None and state._hooks is self:
                state._handlers[2](_tokens(args, kwargs, decoder=False), _mask(kwargs, False))

        def after_encoder(_module: torch.nn.Module, _args: Any, _kwargs: Any, _output: Any) -> None:
            if is_compiling():
                operator([], numbers[3])
                return
            state = _DECODING.get()
            if state is not None and state._hooks is self:
                state._handlers[3]()

        # A torch that cannot define the operator runs them eagerly (a graph break).
        traceable: Callable[[Callable[..., None]], Callable[..., None]] = (
            torch.compiler.disable if operator is None else _same
        )
        model.register_forward_pre_hook(traceable(before), with_kwargs=True)
        model.register_forward_hook(traceable(after), with_kwargs=True, always_call=True)
        if encoder is not None:
            encoder.register_forward_pre_hook(traceable(before_encoder), with_kwargs=True)
            encoder.register_forward_hook(
                traceable(after_encoder), with_kwargs=True, always_call=True
            )


#: Per model, its capture_decode hooks (they hold no reference to the model).
_MODEL_HOOKS: weakref.WeakKeyDictionary[Any, _ModelHooks] = weakref.WeakKeyDictionary()
_MODEL_HOOKS_LOCK = threading.Lock()


def _model_hooks(model: torch.nn.Module, encoder: torch.nn.Module | None) -> _ModelHooks:
    """The model's capture_decode hooks, registered at its first block."""
    with _MODEL_HOOKS_LOCK:
        hooks = _MODEL_HOOKS.get(model)
        if hooks is None:
            hooks = _MODEL_HOOKS[model] = _ModelHooks(model, encoder)
            retrace_compiled()  # code compiled without them would never call them
        return hooks


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

    The first block on a model registers the hooks that see its passes and
    keeps them (they do nothing outside a block), so code torch.compile
    traced before or between blocks calls them too (see :class:`_ModelHooks`).
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

    # What the model's hooks do for this block (in its thread, or carried).
    # They run in forward hooks: whatever goes wrong must not reach the model.
    def on_pass(tokens: Any, mask: Any) -> None:
        step = state.steps
        state.steps += 1
        context = _safe_context(key_list, tokens, mask, step)
        state.current = context
        passes.append(context)
        _CONTEXT.set(context)

    def on_pass_end() -> None:
        if passes:
            passes.pop()

    def on_encoder(tokens: Any, mask: Any) -> None:
        # generate runs an encoder-decoder's encoder once, on its own, before
        # the first pass: its records are the prefill's (the step to come);
        # inside a pass (the model called directly) they are that pass's.
        step = state.steps - 1 if passes else state.steps
        context = _safe_context(key_list, tokens, mask, step)
        passes.append(_CONTEXT.get())
        _CONTEXT.set(context)

    def on_encoder_end() -> None:
        if passes:
            _CONTEXT.set(passes.pop())  # the decoder's context again, in a pass

    state._handlers = (on_pass, on_pass_end, on_encoder, on_encoder_end)
    state._hooks = _model_hooks(model, encoder)
    outer = _CONTEXT.set(None)
    decoding = _DECODING.set(state)
    try:
        yield state
    finally:
        _DECODING.reset(decoding)
        _CONTEXT.reset(outer)


def _same(hook: Callable[..., None]) -> Callable[..., None]:
    return hook


def _safe_context(keys: list[int], tokens: Any, mask: Any, step: int) -> CaptureContext:
    """:func:`_pass_context`, or a context of the keys (and the pass's width)
    alone when it can't be made: its hooks then drop what does not fit them,
    counted, token-major ones included (their rows are keys x width)."""
    try:
        return _pass_context(keys, tokens, mask, step)
    except Exception:
        try:
            width = int(tokens.shape[1])
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


def _mask(kwargs: dict[str, Any], decoder: bool) -> Any:
    """The pass's attention mask (``decoder``: an encoder-decoder's pass, whose
    hooks outside the encoder see the decoder's tokens), or None."""
    return kwargs.get("decoder_attention_mask" if decoder else "attention_mask")


def _pass_context(keys: list[int], tokens: Any, mask: Any, step: int) -> CaptureContext:
    """The context of one forward pass: its rows' keys, its real positions
    (from ``tokens``, ``(rows, width, ...)``, and ``mask``: see :func:`_tokens`
    and :func:`_mask`)."""
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
