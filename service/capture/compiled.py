"""Models run through ``torch.compile``: bind and watch the module it wraps.

``torch.compile(model)`` returns an ``OptimizedModule`` whose submodules are
named ``_orig_mod.<name>``, and whose ``generate`` (any attribute it does not
have) is the wrapped model's, calling the wrapped model itself.  Capture
binds to and watches the wrapped model, so a glob and the hook names are
what they are for the eager model, and a decode loop's passes are seen.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from taproute.service.capture.errors import warn_capture

if TYPE_CHECKING:
    import torch


def uncompiled(model: torch.nn.Module) -> torch.nn.Module:
    """The module ``torch.compile`` wrapped in ``model``, or ``model`` itself."""
    import torch

    optimized = getattr(torch._dynamo.eval_frame, "OptimizedModule", None)
    while optimized is not None and isinstance(model, optimized):
        model = model._orig_mod
    return model


def compiled_fullgraph(model: torch.nn.Module) -> bool:
    """True when ``model`` is ``torch.compile(..., fullgraph=True)``'s module.

    Where torch cannot define the capture operator (see traced.py), a
    capture hook runs eagerly (``torch.compiler.disable``): a graph break,
    which Dynamo refuses under ``fullgraph``, raising out of every forward
    pass of the model.
    """
    import torch

    optimized = getattr(torch._dynamo.eval_frame, "OptimizedModule", None)
    while optimized is not None and isinstance(model, optimized):
        context = getattr(model, "dynamo_ctx", None)
        if getattr(context, "fullgraph", False) or getattr(context, "error_on_graph_break", False):
            return True
        model = model._orig_mod
    return False


def retrace_compiled() -> None:
    """Make code torch.compile has already compiled trace again at its next call.

    Dynamo does not guard on a module's hooks while it has none
    (``torch._dynamo.config.skip_nnmodule_hook_guards``, on by default): a
    model compiled and run before a module of it was bound (or before its
    first capture_decode block) would go on running the code compiled
    without the hook, which then never fires: nothing captured, nothing
    counted.  So every cache entry of compiled
    code is invalidated, as Dynamo does itself when an object its guards
    hold is freed: the next call of each compiled function traces again,
    now with the hook.  Not dropped (``torch.compiler.reset``): that frees
    entries another thread may be running or checking, and crashed the
    process.  Taken under Dynamo's compile lock, so a compile in flight
    ends (with or without the hook) before entries are invalidated; its
    own entry is installed just after the lock is let go, so one that lands
    after the invalidation can still lack the hook (a narrow window).  Once
    per binding (per model for capture_decode); nothing per call.  A torch whose Dynamo
    lacks these internals gets a warning instead.
    """
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
        from torch._dynamo import convert_frame
        from torch._dynamo.guards import DeletedGuardManagerWrapper

        with convert_frame.compile_lock:
            codes = [
                ref() for ref in (*convert_frame.input_codes.seen, *convert_frame.output_codes.seen)
            ]
            for code in codes:
                if code is None:
                    continue
                for entry in _debug_get_cache_entry_list(code):
                    manager = entry.guard_manager
                    extra = getattr(manager, "extra_state", None)
                    if extra is not None and getattr(manager, "cache_entry", None) is not None:
                        extra.invalidate(entry, DeletedGuardManagerWrapper("capture hook bound"))
    except Exception as exc:  # internals of another torch: say so, bind anyway
        warn_capture(
            "bind_module: could not make torch.compile's code compiled so far trace again "
            f"({type(exc).__name__}: {exc}); a model compiled and run before this binding "
            "may not call its hook: bind before compiling, or call torch.compiler.reset() "
            "while no forward pass runs"
        )
