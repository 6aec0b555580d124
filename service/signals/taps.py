"""PyTorch hooks that capture the signal processors' inputs.

Each tap is built on :func:`taproute.service.capture.bind_module`: the
hooks here assemble a tensor ``[batch, tokens, ...]`` and pass it through a
tiny identity module that ``bind_module`` captures, so the capture context,
padding cut, buffer pool and "never outside a capture" rules are the same.

- :func:`bind_qk`: one record per sequence and attention layer, the query
  projection followed by the key projection of each token (layout ``qk``).
- :func:`bind_router`: one record per sequence and MoE layer, the router's
  logits ``[tokens, experts]`` (layout ``router_logits``); works for routers
  that return ``[batch * tokens, experts]`` (transformers' Mixtral, OLMoE,
  Qwen MoE) by taking batch and tokens from the MoE block's input.
- :func:`bind_router_path`: one record per sequence, every MoE layer's router
  logits side by side ``[tokens, layers * experts]`` (layout ``router_path``).

A tap and the hooks feeding it are made at the first binding through them
and shared by later ones.  When the last is removed they are removed too,
unless torch.compile traced them: the tap's capture hook then keeps its
place, inert (see :mod:`taproute.service.capture.slots`), and so do they,
so that binding and removing again costs the compiled model no recompile
(new hooks each time cost one per bind and per remove, and a model
compiled with ``fullgraph=True`` raised ``FailOnRecompileLimitHit`` out of
every pass after a few rounds).  Kept, they still assemble and hand their
tensor to the inert tap in each pass: a compiled model that captured
signals once keeps that small cost.

torch is imported lazily (the rest of taproute never needs it).
"""

from __future__ import annotations

import fnmatch
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from taproute.routing import ConfigError
from taproute.service.capture import HookBinding, HostBufferPool, bind_module
from taproute.service.capture.compiled import uncompiled
from taproute.service.signals.common import layer_of

if TYPE_CHECKING:
    import torch

    from taproute.service.host.runtime import RecordRuntime

    Runtime = RecordRuntime  # a RecordService is one


def _tap() -> torch.nn.Module:
    import torch

    class Tap(torch.nn.Module):
        """Identity: ``bind_module`` captures what goes through it."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    return Tap()


def _matching(model: torch.nn.Module, pattern: str) -> list[tuple[str, torch.nn.Module]]:
    # A compiled model's submodules by their eager names (as bind_modules).
    found = [
        (name, module)
        for name, module in uncompiled(model).named_modules()
        if name and fnmatch.fnmatchcase(name, pattern)
    ]
    if not found:
        raise ConfigError(f"no submodule of the model matches {pattern!r}")
    return found


def _tensor(output: Any) -> torch.Tensor:
    result: torch.Tensor = output[0] if isinstance(output, tuple) else output
    return result


class _Helpers:
    """A tap module and the plain hooks that feed it, shared by every binding
    made through them (``users``)."""

    def __init__(self, tap: torch.nn.Module, handles: list[Any]) -> None:
        self.tap = tap
        self.handles = handles
        self.users = 0


#: Per module the helpers hang on (the first one), its helpers by what they
#: do: (kind, the options and modules that shape them).
_HELPERS: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], _Helpers]] = (
    weakref.WeakKeyDictionary()
)
_HELPERS_LOCK = threading.Lock()


class _Release:
    """A tap binding's handle: removes the capture, then the helpers when
    nothing uses them and no compiled code traced them."""

    def __init__(
        self, captured: HookBinding, anchor: Any, key: tuple[Any, ...], helpers: _Helpers
    ) -> None:
        self._captured: HookBinding | None = captured
        self._anchor = weakref.ref(anchor)
        self._key = key
        self._helpers = helpers

    def remove(self) -> None:
        captured, self._captured = self._captured, None
        if captured is None:
            return
        captured.remove()
        _release(self._anchor(), self._key, self._helpers)


def _release(anchor: Any, key: tuple[Any, ...], helpers: _Helpers) -> None:
    with _HELPERS_LOCK:
        helpers.users -= 1
        # A tap whose capture hook torch.compile traced keeps it, inert
        # (bind_module's remove): the helpers stay too, for the same
        # reason (see the module docstring).
        if helpers.users or helpers.tap._forward_hooks:
            return
        for handle in helpers.handles:
            handle.remove()
        kept = _HELPERS.get(anchor) if anchor is not None else None
        if kept is not None and kept.get(key) is helpers:
            del kept[key]


def _bind_tap(
    runtime: Runtime,
    anchor: torch.nn.Module,
    key: tuple[Any, ...],
    make: Callable[[torch.nn.Module], list[Any]],
    hook: str,
    *,
    layout: str,
    pool: HostBufferPool | None,
) -> HookBinding:
    """Capture hook ``hook`` from the tap of ``anchor``'s helpers ``key``,
    made at their first binding (``make(tap)`` registers the hooks feeding
    ``tap`` and returns their handles)."""
    with _HELPERS_LOCK:
        kept = _HELPERS.setdefault(anchor, {})
        helpers = kept.get(key)
        if helpers is None:
            tap = _tap()
            helpers = kept[key] = _Helpers(tap, make(tap))
        helpers.users += 1
    try:
        captured = bind_module(runtime, helpers.tap, hook, layout=layout, pool=pool)
    except BaseException:
        _release(anchor, key, helpers)
        raise
    return HookBinding(captured.name, captured.output_id, _Release(captured, anchor, key, helpers))


def _bind_each(binds: list[Callable[[], HookBinding]]) -> list[HookBinding]:
    """All the bindings or, when one fails, none of them."""
    bindings: list[HookBinding] = []
    try:
        for bind in binds:
            bindings.append(bind())
    except BaseException:
        for binding in bindings:
            binding.remove()
        raise
    return bindings


def bind_qk(
    runtime: Runtime,
    model: torch.nn.Module,
    pattern: str,
    *,
    query: str = "query",
    key: str = "key",
    layout: str = "qk",
    name: str = "{module}.qk",
    pool: HostBufferPool | None = None,
) -> list[HookBinding]:
    """Capture ``[Q | K]`` per token from each attention module matching ``pattern``.

    ``query``/``key`` name the projection submodules (``q_proj``/``k_proj``
    in most decoder models); the hook name is ``name`` formatted with
    ``module`` (its qualified name) and ``layer`` (the first integer in it).
    The query projection must run before the key projection in the module's
    forward.
    """
    import torch

    pool = pool or HostBufferPool()

    def feed(module: torch.nn.Module) -> Callable[[torch.nn.Module], list[Any]]:
        def make(tap: torch.nn.Module) -> list[Any]:
            stash = threading.local()

            def on_query(_m: Any, _i: Any, output: Any) -> None:
                stash.q = _tensor(output)

            def on_key(_m: Any, _i: Any, output: Any) -> None:
                q = getattr(stash, "q", None)
                stash.q = None
                if q is not None:
                    tap(torch.cat([q, _tensor(output)], dim=-1))

            return [
                module.get_submodule(query).register_forward_hook(on_query),
                module.get_submodule(key).register_forward_hook(on_key),
            ]

        return make

    def binder(qualified: str, module: torch.nn.Module) -> Callable[[], HookBinding]:
        hook = name.format(module=qualified, layer=layer_of(qualified))
        return lambda: _bind_tap(
            runtime, module, ("qk", query, key), feed(module), hook, layout=layout, pool=pool
        )

    return _bind_each(
        [binder(qualified, module) for qualified, module in _matching(model, pattern)]
    )


def _router_hooks(block: torch.nn.Module, gate: str, deliver: Any) -> list[Any]:
    """Hooks handing ``deliver`` the gate's logits as ``[batch, tokens, experts]``."""
    stash = threading.local()

    def before(_m: Any, args: Any) -> None:
        stash.shape = tuple(args[0].shape[:2]) if args else None

    def after(_m: Any, _i: Any, output: Any) -> None:
        shape = getattr(stash, "shape", None)
        if shape is None:
            return
        logits = _tensor(output)
        deliver(logits.reshape(shape[0], shape[1], logits.shape[-1]))

    return [
        block.register_forward_pre_hook(before),
        block.get_submodule(gate).register_forward_hook(after),
    ]


def bind_router(
    runtime: Runtime,
    model: torch.nn.Module,
    pattern: str,
    *,
    gate: str = "gate",
    layout: str = "router_logits",
    pool: HostBufferPool | None = None,
) -> list[HookBinding]:
    """Capture each MoE block's router logits (blocks matching ``pattern``, e.g.
    ``model.layers.*.mlp``); the hook is ``<block>.<gate>``."""
    pool = pool or HostBufferPool()

    def binder(name: str, block: torch.nn.Module) -> Callable[[], HookBinding]:
        def make(tap: torch.nn.Module) -> list[Any]:
            return _router_hooks(block, gate, tap)

        return lambda: _bind_tap(
            runtime, block, ("router", gate), make, f"{name}.{gate}", layout=layout, pool=pool
        )

    return _bind_each([binder(name, block) for name, block in _matching(model, pattern)])


def bind_router_path(
    runtime: Runtime,
    model: torch.nn.Module,
    pattern: str,
    *,
    name: str = "router_path",
    gate: str = "gate",
    layout: str = "router_path",
    pool: HostBufferPool | None = None,
) -> HookBinding:
    """Capture every matching MoE block's router logits of one forward pass as
    one record per sequence, layers side by side in module order (hook ``name``)."""
    import torch

    blocks = _matching(model, pattern)

    def make(tap: torch.nn.Module) -> list[Any]:
        stash = threading.local()
        handles: list[Any] = []
        for index, (_, block) in enumerate(blocks):

            def deliver(logits: torch.Tensor, index: int = index) -> None:
                parts = getattr(stash, "parts", None)
                if index == 0 or parts is None:
                    parts = stash.parts = []
                if len(parts) != index:  # a partial pass (an earlier error): start over
                    stash.parts = None
                    return
                parts.append(logits)
                if len(parts) == len(blocks):
                    stash.parts = None
                    tap(torch.cat(parts, dim=-1))

            handles += _router_hooks(block, gate, deliver)
        return handles

    # Shaped by its blocks (held weakly: the modules, by identity) and gate.
    key = ("router_path", gate, tuple(weakref.ref(block) for _, block in blocks))
    return _bind_tap(runtime, blocks[0][1], key, make, name, layout=layout, pool=pool)
