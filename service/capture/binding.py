"""Bind capture hooks to a model's modules: one record per sequence per call.

``bind_module(runtime, module, name, layout=...)`` registers a forward hook
that copies the module's output to host memory (a CUDA output into a reusable
pinned buffer, copied non-blocking, submitted once the copy is complete; a
CPU output into a fresh array: see :mod:`~taproute.service.capture.host_copy`)
and submits one record per sequence of the batch under ``name``'s output_id.  Which request
each row belongs to, which of its positions are real and the decode step come
from the :func:`~taproute.service.capture.context.capture_context` the server
sets around its forward pass.

Inference comes first.  By default (``on_error="detach"``) nothing a hook
does raises into the forward pass: a capture the context or output makes
impossible is dropped and counted; a binding whose output can never be
captured as bound, or whose runtime has failed, detaches (its later calls
are counted as dropped, reason ``detached``); each problem is warned once per
hook.  ``on_error="raise"`` raises instead (tests, strict users).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from taproute.native import BufferLease, untrack_acyclic
from taproute.routing.batch import RecordBatch
from taproute.routing.errors import IngressFull, SinkClosed
from taproute.service.capture import plans as shared_plans
from taproute.service.capture import slots
from taproute.service.capture.compiled import compiled_fullgraph, retrace_compiled, uncompiled
from taproute.service.capture.context import _CONTEXT, CaptureContext
from taproute.service.capture.errors import CaptureError, ContextMismatch
from taproute.service.capture.extract import (
    Select,
    by_row,
    check_cast,
    check_select,
    pick,
    pick_traced,
    plan,
    real_positions,
    torch_dtype,
)
from taproute.service.capture.hook_binding import (
    BAD_OUTPUT,
    DETACHED,
    INGRESS_FULL,
    INVALID_CONTEXT,
    MAX_BLOCK,
    NO_CONTEXT,
    RUNTIME_CLOSED,
    RUNTIME_FAILED,
    CaptureTarget,
    HookBinding,
    check_unbound,
    note_bound,
)
from taproute.service.capture.host_copy import numpy_view_dtype, to_host
from taproute.service.capture.plans import SharedPlan
from taproute.service.capture.pool import HostBufferPool
from taproute.service.capture.traced import Picked, capture_operator, new_number, register

if TYPE_CHECKING:
    import torch

OnError = Literal["detach", "raise"]


#: A forward hook: (module, inputs, output) -> None.
_Hook = Callable[[Any, Any, Any], None]


def _layout_element(target: CaptureTarget, layout: str, name: str) -> np.dtype[Any]:
    if target.schema is None:
        raise CaptureError(
            f"bind_module({name!r}): the runtime has no schema (layouts to capture into)"
        )
    spec = target.schema.layout(layout)
    tail = spec.tail
    if tail is None or spec.prefix_size:
        raise CaptureError(
            f"bind_module({name!r}): layout {layout!r} must be a single variable-length "
            "Array column (captures vary in token count)"
        )
    return tail.element_dtype


def _check_parameters(
    module: torch.nn.Module, dst: torch.dtype, *, name: str, layout: str, narrow: bool
) -> None:
    """A module computing in floats cannot fill an integer layout: refuse at bind time.

    A float layout narrower than the parameters (BFloat16 for a float32
    module) is left to the first call's check of the output itself: under
    ``torch.autocast`` such a module's outputs are bf16 or fp16, which the
    layout may hold exactly.
    """
    if dst.is_floating_point:
        return
    for parameter in module.parameters(recurse=True):
        if parameter.is_floating_point():
            check_cast(parameter.dtype, dst, hook=name, layout=layout, narrow=narrow)
            return


#: What a capture hook calls on its runtime (CaptureTarget's methods).
_TARGET_CALLS = ("bind_hook", "offer_captured", "count_dropped", "count_skipped")
#: What a hook takes from its buffer pool (HostBufferPool, a writer's SharedBufferPool).
_POOL_CALLS = ("take", "take_host", "give_back")


def _check_options(
    where: str,
    runtime: object,
    *,
    token_major: object,
    narrow: object,
    pool: object,
    token_axis: object = None,
) -> None:
    """Refuse, at bind time, what a hook's first call would trip on (and then
    count as a failed runtime): a runtime that is not one, a pool that is not
    one, a flag that is not a bool (narrow="no" was narrow), a token axis
    that is not a dimension after the batch's."""
    if not (
        all(callable(getattr(runtime, call, None)) for call in _TARGET_CALLS)
        and hasattr(runtime, "hooks")
        and hasattr(runtime, "schema")
    ):
        raise CaptureError(
            f"{where}: runtime must be the runtime the hooks submit to (what "
            f"create_record_runtime returns), found {type(runtime).__name__}"
        )
    for flag, value in (("token_major", token_major), ("narrow", narrow)):
        if not isinstance(value, bool):
            raise CaptureError(
                f"{where}: {flag} must be True or False, found {type(value).__name__} {value!r}"
            )
    if token_axis is not None:
        if isinstance(token_axis, bool) or not isinstance(token_axis, int) or token_axis < 1:
            raise CaptureError(
                f"{where}: token_axis must be the index of the output's token dimension, "
                f"an int >= 1 (dimension 0 is the batch), found {token_axis!r}"
            )
        if token_major is True:
            raise CaptureError(
                f"{where}: token_axis and token_major=True exclude each other (a token-major "
                "output's tokens are its rows)"
            )
    if pool is not None and not (
        all(callable(getattr(pool, call, None)) for call in _POOL_CALLS)
        and hasattr(pool, "cpu_outputs")
    ):
        raise CaptureError(
            f"{where}: pool must be a HostBufferPool (or a writer sink's buffer_pool), "
            f"found {type(pool).__name__} {pool!r:.60}"
        )


def _check_module(where: str, what: str, value: object) -> None:
    import torch

    if not isinstance(value, torch.nn.Module):
        raise CaptureError(
            f"{where}: {what} must be a torch.nn.Module, found {type(value).__name__}"
        )
    if compiled_fullgraph(value) and capture_operator() is None:
        raise CaptureError(
            f"{where}: the {what} was compiled with torch.compile(fullgraph=True), and this "
            "torch cannot trace capture hooks (no capture operator): a hook would run "
            "eagerly, a graph break that fullgraph refuses, so every forward pass would "
            "raise: compile it without fullgraph=True to capture from it"
        )


def _capture_hook(
    is_compiling: Callable[[], bool],
    operator: Any,
    select: Select,
    number: int,
    current: Callable[[], CaptureContext | None],
    skipped: Callable[[], None],
    runtime: Any,
    name: Any,
    binding: Any,
    capture: Any,
    on_error: Any,
) -> _Hook:
    """A binding's forward hook; with ``current`` that gives no context and
    ``skipped`` that does nothing (the rest unused: None), the inert hook a
    removed binding leaves in its place (see slots.py).

    Every hook is made here, so all have one code: Dynamo guards compiled
    code on a traced hook's code and on what its traced branch reads
    (``is_compiling``, ``operator``, ``select``, ``number``), never on the
    hook object nor on what the eager branch reads.  A binding and the
    inert hook of the same place are thus the same hook to compiled code.
    """

    def hook(_module: torch.nn.Module | None, _inputs: Any, output: Any) -> None:
        if is_compiling():
            # Traced by torch.compile (never reached eagerly, nor when the
            # operator is missing: the hook is then disabled for Dynamo):
            # the graph calls the capture operator, whose kernel runs this
            # hook eagerly with the real tensor.  No graph break.
            operator([pick_traced(output, select)], number)
            return
        context = current()
        if context is None:
            skipped()
            return
        if binding.error is not None:
            runtime.count_dropped(name, DETACHED, len(context.keys))
            return
        try:
            capture(output, context)
        except IngressFull as exc:
            if on_error == "raise":
                raise
            # The runtime refuses while full (when_full="reject"): this call only.
            runtime.count_dropped(name, INGRESS_FULL, len(context.keys))
            binding._warn_once(INGRESS_FULL, f"hook {name!r}: {exc} (reason 'ingress_full')")
        except ContextMismatch as exc:
            if on_error == "raise":
                raise
            # A context that doesn't fit loses this call only.
            runtime.count_dropped(name, INVALID_CONTEXT, len(context.keys))
            binding._warn_once(
                INVALID_CONTEXT, f"{exc}; records dropped (reason 'invalid_context')"
            )
        except CaptureError as exc:
            if on_error == "raise":
                raise
            # An output that can't be captured as bound (type, dtype) would lose
            # every call: the binding detaches.
            binding.error = exc
            runtime.count_dropped(name, BAD_OUTPUT, len(context.keys))
            binding._warn_once(
                BAD_OUTPUT, f"{exc}; the hook detached and drops its records (reason 'detached')"
            )
        except SinkClosed as exc:
            if on_error == "raise":
                raise
            # Closed without a failure (a model still running after shutdown
            # began): nothing went wrong with the capture, each call is counted.
            runtime.count_dropped(name, RUNTIME_CLOSED, len(context.keys))
            binding._warn_once(
                RUNTIME_CLOSED, f"hook {name!r}: {exc}; records dropped (reason 'runtime_closed')"
            )
        except Exception as exc:
            if on_error == "raise":
                raise
            binding.error = exc
            runtime.count_dropped(name, RUNTIME_FAILED, len(context.keys))
            binding._warn_once(
                RUNTIME_FAILED,
                f"hook {name!r}: capture failed ({type(exc).__name__}: {exc}); the hook "
                "detached and drops its records from now on (reason 'detached')",
            )

    return hook


def _nothing() -> None:
    """The inert hook's context (none) and what it does without one (nothing)."""
    return None


def bind_module(
    runtime: CaptureTarget,
    module: torch.nn.Module,
    name: str,
    *,
    layout: str,
    select: Select = None,
    token_major: bool = False,
    token_axis: int | None = None,
    narrow: bool = False,
    on_error: OnError = "detach",
    pool: HostBufferPool | None = None,
) -> HookBinding:
    """Capture ``module``'s output as records of ``layout`` under hook ``name``.

    ``select`` says what to take from an output that is not one tensor: an
    index (tuples, lists), a key or attribute name (dicts, ``ModelOutput``)
    or a callable; without it the output must be a tensor or a tuple/list
    whose first item is one.  The captured tensor is ``(batch, ...)``: row
    ``i`` becomes one record keyed by the context's ``keys[i]``.  Dimension 1
    of a 3-D tensor is its token axis: the record holds the row's real
    positions (``lengths`` or ``attention_mask``), shaped ``[tokens, *rest]``;
    a 2-D ``(batch, features)`` output gives each row whole.
    ``token_major=True``: the tensor is ``(batch * tokens, ...)``, as MoE
    routers return their logits.  ``token_axis=k``: dimension ``k`` holds the
    tokens (2 for attention weights ``(batch, heads, queries, keys)``); the
    record holds the real positions along it, shaped ``[tokens, *the other
    dimensions in order]`` (``[queries, heads, keys]``).  A tensor of 4 or
    more dimensions has no default token axis (dimension 1 is as often heads
    as tokens): without ``token_axis`` its rows are captured whole when the
    context says no positions, and a call whose context has ``lengths`` or
    a mask is refused (``bad_output``: the binding detaches, warned, naming
    ``token_axis``) rather than cut at the wrong dimension.

    Values keep their dtype when the layout's element type is the same; a
    widening cast (bf16 -> Float32) is exact and allowed; one that changes
    values (float -> integer, fp32 -> BFloat16) is refused unless ``narrow``
    (floats only).  Checked now where it can be (layout, ``select``, a float
    module's output bound to an integer layout without ``select``), else at
    the first call (a float narrowing: under autocast the outputs need not
    have the parameters' dtype; whatever ``select`` picks).
    """
    import torch

    where = f"bind_module({name!r})"
    _check_options(
        where, runtime, token_major=token_major, narrow=narrow, pool=pool, token_axis=token_axis
    )
    _check_module(where, "module", module)
    if on_error not in ("detach", "raise"):
        raise CaptureError(f"bind_module({name!r}): on_error must be 'detach' or 'raise'")
    check_select(select, hook=name)
    element = _layout_element(runtime, layout, name)
    dst = torch_dtype(element)
    if select is None:  # what a select picks need not be float (a router's top-k indices)
        _check_parameters(module, dst, name=name, layout=layout, narrow=narrow)
    check_unbound(module, runtime.hooks, name)
    output_id = runtime.bind_hook(name, layout=layout)
    layout_id = runtime.schema.layout_id(layout)  # type: ignore[union-attr]
    hooks = runtime.hooks
    pool = pool or HostBufferPool()
    binding = HookBinding(name, output_id)
    checked: set[torch.dtype] = {dst}
    shape_noted: list[tuple[int, ...] | None] = []
    plain = select is None
    tensor_type = torch.Tensor
    as_numpy = numpy_view_dtype(dst)
    element_size = dst.itemsize
    # Plans differ by layout (the template's layout_id), element size (a
    # layout id means different layouts in different runtimes' schemas) and
    # the token axis option (a 4-D output without one is judged at planning).
    element_key = (layout_id, element_size, token_axis)
    explicit_axis = token_axis is not None
    axis = token_axis or 0
    judge_axis = not explicit_axis and not token_major  # a 4-D output's axis is unknown

    def capture(output: Any, context: CaptureContext) -> None:
        """Copy and submit one call's records; CaptureError when impossible.

        Kept to a handful of Python operations per call (it runs on the
        model's thread inside the forward pass): what depends only on the
        output's shape and the context is planned once per forward pass.
        """
        if not plain or type(output) is not tensor_type:
            if plain and type(output) is tuple and output and type(output[0]) is tensor_type:
                output = output[0]  # pick()'s first rule, without the call
            else:
                output = pick(output, select, hook=name)
        tensor = output
        shape = tensor.shape
        if token_major or not shape or shape[0] != len(context.keys):
            tensor = by_row(tensor, context, hook=name, token_major=token_major)
            shape = tensor.shape
        if explicit_axis:  # the token axis said at bind time: moved to dimension 1
            if len(shape) <= axis:
                raise CaptureError(
                    f"hook {name!r}: token_axis={axis} but the output has {len(shape)} "
                    f"dimensions (shape {tuple(shape)})"
                )
            if axis > 1:
                tensor = tensor.movedim(axis, 1)  # a view; copied once, to the host
                shape = tensor.shape
            token_axis = True
        else:
            token_axis = token_major or len(shape) >= 3
        if tensor.requires_grad:  # inference tensors never do: no new view per call
            tensor = tensor.detach()
        owned = False
        if tensor.dtype is not dst:
            if tensor.dtype not in checked:
                check_cast(tensor.dtype, dst, hook=name, layout=layout, narrow=narrow)
                checked.add(tensor.dtype)
            tensor = tensor.to(dst)  # exact (checked above) or narrowing on purpose
            owned = True
        # One plan per output shape and context, shared by every hook of the
        # forward pass, and built from a plan shared between contexts.
        plan_key = (shape, token_axis, element_key)
        cached = context.plans.get(plan_key)
        if cached is None:
            cached = _context_plan(shape, token_axis, plan_key, context)
        if token_axis and not context.runs:
            tensor, owned = real_positions(tensor, context), True
        if not shape_noted or shape_noted[0] != cached[0]:
            _note_shape(cached[0])
        descriptors, payload, release = to_host(
            tensor, pool, owned, as_numpy, cached, output_id, context.key_array, context.step
        )
        # Descriptors made here from the plan are right by construction: the
        # batch is offered as it is, without the intake's check.
        lease = BufferLease(release)
        batch = RecordBatch(descriptors, payload, lease, cached[3])
        # Arrays, an int, a lease whose callback gives a buffer back to its
        # pool: no cycle, so kept out of the cyclic GC, which would promote
        # every queued batch to its oldest generation (see untrack_acyclic).
        untrack_acyclic(batch, lease, release)
        try:
            queued = runtime.offer_captured(batch)
        except BaseException:
            if release is not None:
                release()  # refused: the runtime never took it
            raise
        if not queued:
            if release is not None:
                release()
            runtime.count_dropped(name, MAX_BLOCK, len(context.keys))
            binding._warn_once(
                MAX_BLOCK,
                f"hook {name!r}: ingress stayed full longer than max_block; records shed "
                "(counted as dropped, reason 'max_block')",
            )

    def _context_plan(
        shape: tuple[int, ...], token_axis: bool, plan_key: Any, context: CaptureContext
    ) -> SharedPlan:
        """The plan for ``shape`` and the context's real positions, built at
        most once while the shared cache keeps it; the context's keys and step
        are stamped per call, so contexts alike in shape and mask share it.

        Also where a tensor of 4 or more dimensions bound without
        ``token_axis`` is refused under a context with real positions:
        once per shape and context, not per call."""
        if judge_axis and len(shape) >= 4 and context.has_positions:
            raise CaptureError(
                f"hook {name!r}: the output is {len(shape)}-D (shape {tuple(shape)}) and the "
                "capture context says which positions are real (lengths or attention_mask), "
                "but which dimension holds the tokens is not known: dimension 1 of a 4-D "
                "output is as often heads (attention weights (batch, heads, queries, keys)) "
                "as tokens. Bind it with token_axis= (2 for attention weights, 1 for "
                "(batch, tokens, heads, dim))"
            )
        shared_key = (plan_key, context.positions_key)
        plans = shared_plans.SHARED_PLANS
        shared = plans.get(shared_key)
        if shared is None:
            made = plan(
                shape,
                element_size,
                context,
                hook=name,
                token_axis=token_axis,
                layout_id=layout_id,
            )
            shared = (
                made.token_shape,
                made.offsets,
                made.lengths,
                made.covered,
                made.packed,
                made.in_source,
            )
            plans.put(shared_key, shared)
        context.plans[plan_key] = shared
        return shared

    def _note_shape(token_shape: tuple[int, ...] | None) -> None:
        if not shape_noted:
            shape_noted.append(token_shape)
            hooks.set_token_shape(output_id, token_shape)
        elif shape_noted[0] is not None:
            # Records of one hook share one token shape; when it varies, say
            # none (flat shapes) rather than a shape older records don't have.
            shape_noted[0] = None
            hooks.set_token_shape(output_id, None)

    def skipped() -> None:
        runtime.count_skipped(name, NO_CONTEXT)
        binding._warn_once(
            NO_CONTEXT,
            f"hook {name!r} ran outside a capture_context: nothing captured (in a worker "
            "thread, run the model through carry_context(...)); counted as skipped",
        )

    # Under torch.compile, Dynamo traces the hook: it takes the branch that
    # calls the capture operator (see traced.py).  A torch that cannot
    # define the operator runs the hook eagerly instead (a graph break).
    is_compiling = torch.compiler.is_compiling
    operator = capture_operator()
    current = _CONTEXT.get
    slot = None if operator is None else slots.take(module, select)
    number = new_number() if slot is None else slot.number
    hook = _capture_hook(
        is_compiling,
        operator,
        select,
        number,
        current,
        skipped,
        runtime,
        name,
        binding,
        capture,
        on_error,
    )

    def run(tensors: list[Any]) -> None:
        """The capture operator's kernel: the hook, eagerly, on the real output.
        Compiled code keeps calling the operator with this place's number
        after remove(): until the place is bound again (another runner for
        the number), this removed binding's captures nothing, as eagerly."""
        if binding.removed:
            return
        (output,) = tensors
        # What the traced hook picked, not picked again (a select applied
        # to the tensor it selected took its first row, or failed).
        hook(None, None, output if plain and output is not None else Picked(output))

    # The operator holds ``run`` weakly: it lives as long as the hook does.
    setattr(hook, "runner", run)  # noqa: B010
    register(run, number)
    unhooked = not module._forward_hooks
    if slot is None:
        eager: Callable[[_Hook], _Hook] = torch.compiler.disable
        binding._handle = module.register_forward_hook(eager(hook))
    else:
        # What remove() leaves in the hook's place once compiled code traced it.
        inert = _capture_hook(
            is_compiling, operator, select, number, _nothing, _nothing, *(None,) * 5
        )
        slots.place(module, slot, hook)
        binding._handle = slots.SlotHandle(module, slot, inert)
    note_bound(module, hooks, binding)
    if unhooked:
        retrace_compiled()
    return binding


def bind_modules(
    runtime: CaptureTarget,
    model: torch.nn.Module,
    pattern: str,
    *,
    layout: str,
    prefix: str = "",
    select: Select = None,
    token_major: bool = False,
    token_axis: int | None = None,
    narrow: bool = False,
    on_error: OnError = "detach",
    pool: HostBufferPool | None = None,
) -> list[HookBinding]:
    """Bind every submodule whose qualified name matches ``pattern`` (a glob).

    Hook names are ``prefix + qualified name``; one buffer pool serves all;
    the other options are :func:`bind_module`'s.  Raises if nothing matches.
    """
    _check_options(
        "bind_modules",
        runtime,
        token_major=token_major,
        narrow=narrow,
        pool=pool,
        token_axis=token_axis,
    )
    _check_module("bind_modules", "model", model)
    if not isinstance(prefix, str):
        raise CaptureError(
            f"bind_modules: prefix must be a str, found {type(prefix).__name__} {prefix!r}"
        )
    model = uncompiled(model)  # a compiled model's submodules under their own names
    matches = [
        (qualified, module)
        for qualified, module in model.named_modules()
        if qualified and fnmatch.fnmatchcase(qualified, pattern)
    ]
    if not matches:
        raise CaptureError(f"bind_modules: no submodule of the model matches {pattern!r}")
    for qualified, module in matches:  # all or nothing: none bound when one already is
        check_unbound(module, runtime.hooks, prefix + qualified)
    pool = pool or HostBufferPool()
    return [
        bind_module(
            runtime,
            module,
            prefix + qualified,
            layout=layout,
            select=select,
            token_major=token_major,
            token_axis=token_axis,
            narrow=narrow,
            on_error=on_error,
            pool=pool,
        )
        for qualified, module in matches
    ]
