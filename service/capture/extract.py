"""From a module's output to the exact bytes of one record per sequence.

Pure functions over tensors and the capture context, in the order a hook
applies them: :func:`pick` the tensor out of the output, reshape a
:func:`token_major <by_row>` tensor to ``(batch, tokens, ...)``, refuse a
:func:`lossy cast <check_cast>`, and :func:`plan` which bytes of the copied
tensor each record holds (gathering a mask's :func:`real_positions` first
when they are not one run per row).  Every refusal is a :class:`CaptureError` naming
the hook and what was expected and found.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import numpy.typing as npt

from taproute.native import plan_records
from taproute.service.capture.context import CaptureContext
from taproute.service.capture.errors import CaptureError, ContextMismatch
from taproute.service.capture.traced import Picked

if TYPE_CHECKING:
    import torch

#: What to take from a module's output: an index, a key or attribute name, or a function.
Select = int | str | Callable[[Any], Any] | None


def check_select(select: Select, *, hook: str) -> None:
    """Refuse a ``select`` that is none of the accepted kinds (at bind time)."""
    if select is None or callable(select) or isinstance(select, str):
        return
    if isinstance(select, int) and not isinstance(select, bool):
        return
    raise CaptureError(
        f"hook {hook!r}: select must be an index, a key or a callable, "
        f"got {type(select).__name__} {select!r}"
    )


def pick(output: Any, select: Select, *, hook: str) -> torch.Tensor:
    """The tensor to capture from ``output``.

    Without ``select``: the output itself when it is a tensor, else the first
    item of a tuple or list (torch's and transformers' convention: the main
    output first).  Anything else must say what to take with ``select``.
    """
    import torch

    if type(output) is Picked:  # picked already, by a hook traced by torch.compile
        if output.tensor is not None:
            return output.tensor  # type: ignore[no-any-return]
        what = "the module's output" if select is None else f"select={select!r}"
        raise CaptureError(
            f"hook {hook!r}: under torch.compile, {what} gave no tensor to capture (the "
            "output is not a tensor, nor a tuple/list whose first item is one, or select "
            "does not pick one)"
        )
    if select is None:
        if isinstance(output, torch.Tensor):
            return output
        if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
            return output[0]
        raise CaptureError(
            f"hook {hook!r}: the module returned {_describe(output)}, not a tensor; say what "
            "to capture with select= (an index, a key, or a callable)"
        )
    try:
        if callable(select):
            value = select(output)
        elif isinstance(select, str):
            value = output[select] if isinstance(output, Mapping) else getattr(output, select)
        else:
            value = output[select]
    except (IndexError, KeyError, AttributeError, TypeError) as exc:
        raise CaptureError(
            f"hook {hook!r}: select={select!r} does not apply to {_describe(output)} "
            f"({type(exc).__name__}: {exc})"
        ) from None
    except Exception as exc:  # the user's select callable: an output it can't take
        raise CaptureError(
            f"hook {hook!r}: select={select!r} raised {type(exc).__name__} on "
            f"{_describe(output)}: {exc}"
        ) from exc
    if not isinstance(value, torch.Tensor):
        raise CaptureError(
            f"hook {hook!r}: select={select!r} picked {_describe(value)} out of "
            f"{_describe(output)}, not a tensor"
        )
    return value


def pick_traced(output: Any, select: Select) -> torch.Tensor | None:
    """:func:`pick` as torch.compile traces it: the tensor, or None where
    :func:`pick` would refuse (nothing raised into the graph being traced;
    the capture's kernel refuses None as an output it cannot capture)."""
    import torch

    value: Any
    if select is None:
        value = output[0] if isinstance(output, tuple | list) and len(output) > 0 else output
    elif callable(select):
        value = select(output)
    elif isinstance(select, str):
        value = output.get(select) if isinstance(output, Mapping) else getattr(output, select, None)
    elif isinstance(output, tuple | list):
        value = output[select] if -len(output) <= select < len(output) else None
    else:
        value = output[select]  # a ModelOutput: an item of its tuple
    return value if isinstance(value, torch.Tensor) else None


def _describe(value: Any) -> str:
    kind = type(value)
    builtin = kind.__module__ == "builtins"
    name = kind.__name__ if builtin else f"{kind.__module__}.{kind.__qualname__}"
    if isinstance(value, Mapping):
        return f"a {name} with keys {list(value.keys())}"
    if isinstance(value, tuple | list):
        items = ", ".join(type(v).__name__ for v in value)
        return f"a {name} of ({items})"
    return "None" if value is None else f"a {name}"


def torch_dtype(element: np.dtype[Any]) -> torch.dtype:
    """The torch dtype of a layout's array element type."""
    import torch

    if element == np.dtype("bfloat16"):
        return torch.bfloat16
    return torch.from_numpy(np.empty(0, dtype=element)).dtype


def _exact_cast(src: torch.dtype, dst: torch.dtype) -> bool:
    """True when every value of ``src`` is exactly a value of ``dst``."""
    import torch

    if src == dst or src == torch.bool:
        return True
    if src.is_complex or dst.is_complex or dst == torch.bool:
        return False
    if src.is_floating_point:
        if not dst.is_floating_point:
            return False
        s, d = torch.finfo(src), torch.finfo(dst)
        return d.bits >= s.bits and d.eps <= s.eps and d.max >= s.max
    if dst.is_floating_point:  # integers: exact while they fit the mantissa
        mantissa = {torch.float16: 11, torch.bfloat16: 8, torch.float32: 24, torch.float64: 53}
        info = torch.iinfo(src)
        return max(abs(info.min), info.max).bit_length() <= mantissa.get(dst, 0)
    s_int, d_int = torch.iinfo(src), torch.iinfo(dst)
    return d_int.min <= s_int.min and d_int.max >= s_int.max


def check_cast(src: torch.dtype, dst: torch.dtype, *, hook: str, layout: str, narrow: bool) -> None:
    """Refuse a cast that would change values (``narrow`` allows float -> narrower float)."""
    if _exact_cast(src, dst):
        return
    if narrow and src.is_floating_point and dst.is_floating_point:
        return
    hint = (
        " (pass narrow=True to round floats to it on purpose)"
        if src.is_floating_point and dst.is_floating_point
        else ""
    )
    raise CaptureError(
        f"hook {hook!r}: output dtype {src} would be cast to {dst} for layout {layout!r}, "
        f"which changes values; refused{hint}"
    )


def by_row(
    tensor: torch.Tensor, context: CaptureContext, *, hook: str, token_major: bool
) -> torch.Tensor:
    """``tensor`` as ``(rows, ...)`` with one row per context key.

    ``token_major``: the tensor is ``(rows * tokens, ...)`` (an MoE router's
    logits); it is viewed as ``(rows, tokens, ...)``.
    """
    rows = len(context.keys)
    if tensor.dim() == 0:
        raise CaptureError(f"hook {hook!r}: the output is a scalar; nothing to split by row")
    if token_major:
        lead = tensor.shape[0]
        positions = context.positions
        if positions is None:
            if rows == 0 or lead % rows:
                raise ContextMismatch(
                    f"hook {hook!r}: token-major output has {lead} rows, not a multiple of "
                    f"the capture context's {rows} keys (shape {tuple(tensor.shape)})"
                )
            positions = lead // rows
        elif lead != rows * positions:
            raise ContextMismatch(
                f"hook {hook!r}: token-major output has {lead} rows but the capture context "
                f"has {rows} keys x {positions} positions = {rows * positions}"
            )
        return tensor.reshape(rows, positions, *tensor.shape[1:])
    if tensor.shape[0] != rows:
        hint = (
            "; a token-major output (batch * tokens, ...) needs token_major=True"
            if rows and tensor.shape[0] % rows == 0 and tensor.shape[0] > rows
            else ""
        )
        raise ContextMismatch(
            f"hook {hook!r}: output has {tensor.shape[0]} rows (shape {tuple(tensor.shape)}) "
            f"but the capture context has {rows} keys{hint}"
        )
    return tensor


@attrs.frozen
class RecordPlan:
    """Which bytes of a captured tensor (copied whole, contiguous) each record
    holds, and the descriptor templates for them.

    ``token_shape`` is the shape of one position's values (records hold
    ``[tokens, *token_shape]``), or None when the output has no token axis;
    ``covered`` is the bytes the records cover together.  ``packed`` and
    ``in_source`` are read-only descriptor templates (layout, seq, offset,
    length; output_id, time, key and step are stamped per call) for the
    records copied back to back and for them at their offsets in the
    tensor.  For a context whose real positions are not one run per row,
    the tensor is :func:`real_positions` of the output, not the output.

    A plan depends only on the tensor's shape and element size, whether it
    has a token axis, the layout and the context's real positions (its
    ``positions_key``): never on the values, the keys or the step.
    """

    offsets: npt.NDArray[np.int64]
    lengths: npt.NDArray[np.int64]
    covered: int
    packed: npt.NDArray[np.void]
    in_source: npt.NDArray[np.void]
    token_shape: tuple[int, ...] | None


def plan(
    shape: tuple[int, ...],
    element: int,
    context: CaptureContext,
    *,
    hook: str,
    token_axis: bool,
    layout_id: int,
) -> RecordPlan:
    """The records of a tensor of ``shape`` (``(rows, ...)``, one row per key)
    and ``element`` bytes per value, in ``layout_id``'s layout.

    With a token axis (dimension 1; every output of 3 or more dimensions, and
    token-major ones), each record holds its row's real positions; without
    one, the whole row.  One native call (:func:`~taproute.native.plan_records`).
    """
    rows = shape[0]
    if len(shape) == 1 or not token_axis or not context.has_positions:
        row_bytes = math.prod(shape[1:]) * element
        token_shape = tuple(shape[2:]) if token_axis else None
        return RecordPlan(
            *plan_records(rows, row_bytes, 0, 0, None, None, True, layout_id), token_shape
        )
    positions = shape[1]
    token_shape = tuple(shape[2:])
    if context.positions is not None and context.positions != positions:
        raise ContextMismatch(
            f"hook {hook!r}: the attention mask has {context.positions} positions but the "
            f"output has {positions} (shape {tuple(shape)})"
        )
    counts = context.counts
    assert counts is not None
    if context.longest > positions:
        row = int(np.flatnonzero(counts > positions)[0])
        raise ContextMismatch(
            f"hook {hook!r}: lengths[{row}] = {counts[row]} but the output has only "
            f"{positions} positions per row (shape {tuple(shape)})"
        )
    per_token = math.prod(token_shape) * element
    # Not one run per row: the records are the mask's positions, gathered
    # (real_positions) into one tensor, back to back.
    made = plan_records(
        rows, 0, per_token, positions, counts, context.starts, context.runs, layout_id
    )
    return RecordPlan(*made, token_shape)


def real_positions(tensor: torch.Tensor, context: CaptureContext) -> torch.Tensor:
    """``tensor``'s real positions, row after row (``(real positions, ...)``),
    for a context whose mask is not one run per row (``context.runs`` False)."""
    mask = context.mask
    assert mask is not None
    return tensor[mask.to(tensor.device, non_blocking=True)]
