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

torch is imported lazily (the rest of taproute never needs it).
"""

from __future__ import annotations

import fnmatch
import threading
from typing import TYPE_CHECKING, Any

from taproute.routing import ConfigError
from taproute.service.capture import HookBinding, HostBufferPool, bind_module
from taproute.service.signals.common import layer_of

if TYPE_CHECKING:
    import torch

    from taproute.service.host.runtime import RecordRuntime

    Runtime = RecordRuntime  # a RecordService is one


class _Handles:
    """Several removable hook handles removed as one."""

    def __init__(self, handles: list[Any]) -> None:
        self._handles = handles

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _tap() -> torch.nn.Module:
    import torch

    class Tap(torch.nn.Module):
        """Identity: ``bind_module`` captures what goes through it."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    return Tap()


def _matching(model: torch.nn.Module, pattern: str) -> list[tuple[str, torch.nn.Module]]:
    found = [
        (name, module)
        for name, module in model.named_modules()
        if name and fnmatch.fnmatchcase(name, pattern)
    ]
    if not found:
        raise ConfigError(f"no submodule of the model matches {pattern!r}")
    return found


def _tensor(output: Any) -> torch.Tensor:
    result: torch.Tensor = output[0] if isinstance(output, tuple) else output
    return result


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
    bindings = []
    for qualified, module in _matching(model, pattern):
        tap = _tap()
        hook = name.format(module=qualified, layer=layer_of(qualified))
        captured = bind_module(runtime, tap, hook, layout=layout, pool=pool)
        stash = threading.local()

        def on_query(_m: Any, _i: Any, output: Any, stash: Any = stash) -> None:
            stash.q = _tensor(output)

        def on_key(_m: Any, _i: Any, output: Any, stash: Any = stash, tap: Any = tap) -> None:
            q = getattr(stash, "q", None)
            stash.q = None
            if q is not None:
                tap(torch.cat([q, _tensor(output)], dim=-1))

        handles = [
            module.get_submodule(query).register_forward_hook(on_query),
            module.get_submodule(key).register_forward_hook(on_key),
            captured,
        ]
        bindings.append(HookBinding(captured.name, captured.output_id, _Handles(handles)))
    return bindings


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
    bindings = []
    for name, block in _matching(model, pattern):
        tap = _tap()
        captured = bind_module(runtime, tap, f"{name}.{gate}", layout=layout, pool=pool)
        handles = [*_router_hooks(block, gate, tap), captured]
        bindings.append(HookBinding(captured.name, captured.output_id, _Handles(handles)))
    return bindings


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
    tap = _tap()
    captured = bind_module(runtime, tap, name, layout=layout, pool=pool)
    stash = threading.local()
    handles: list[Any] = [captured]
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
    return HookBinding(captured.name, captured.output_id, _Handles(handles))
