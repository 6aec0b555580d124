"""Models run through ``torch.compile``: bind and watch the module it wraps.

``torch.compile(model)`` returns an ``OptimizedModule`` whose submodules are
named ``_orig_mod.<name>``, and whose ``generate`` (any attribute it does not
have) is the wrapped model's, calling the wrapped model itself.  Capture
binds to and watches the wrapped model, so a glob and the hook names are
what they are for the eager model, and a decode loop's passes are seen.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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

    A capture hook runs eagerly (``torch.compiler.disable``): a graph break,
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
