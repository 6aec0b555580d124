"""Which numpy arrays may carry a layout's payload.

A payload is taken as bytes, never converted (a batch's descriptors give
byte offsets into the producer's buffer, which is not copied).  So an array
handed in is checked against the layout its records name: a plain numeric
array must be of the layout's element type (``Array(Float32)`` takes
``float32``; a float64 array's bytes would be read as garbage float32
values, or refused for their size only by luck).  ``uint8`` arrays,
bytes-like objects and structured or void arrays are raw bytes and are taken
as they are, as is any array for a layout whose columns mix element types
(no one numeric dtype describes it).

A single record (``submit``), which is copied anyway, is converted where the
conversion is exact (``float16`` -> ``float32``, ``int16`` -> ``int32``,
``int16`` -> ``float32``); any other mismatch is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from taproute.routing.errors import PayloadDtypeMismatch
from taproute.routing.layout import Layout

if TYPE_CHECKING:
    from taproute.routing.schema import RecordSchema

#: Bits of a float's significand (with the implicit bit): integers up to this
#: many bits convert to it exactly.
_SIGNIFICAND_BITS = {2: 11, 4: 24, 8: 53}


def is_raw(dtype: np.dtype[Any]) -> bool:
    """True for dtypes that are bytes, not values: ``uint8``, void, ``S``."""
    return dtype == np.uint8 or dtype.kind in "VS"


def exact_cast(found: np.dtype[Any], expected: np.dtype[Any]) -> bool:
    """True when every value of ``found`` converts to ``expected`` exactly."""
    if not np.can_cast(found, expected, casting="safe"):
        return False
    if found.kind in "iub" and expected.kind in "fc":
        bits = found.itemsize * 8 - (found.kind == "i")
        float_size = expected.itemsize // (2 if expected.kind == "c" else 1)
        return bits <= _SIGNIFICAND_BITS.get(float_size, 0)
    return True


def fits(found: np.dtype[Any], layout: Layout, *, single: bool) -> bool:
    """Whether an array of ``found`` may carry ``layout``'s payload: raw bytes,
    the layout's element type, any array for a mixed layout, and for a
    ``single`` record an exact conversion."""
    expected = layout.element_dtype
    if is_raw(found) or expected is None or found == expected:
        return True
    return single and exact_cast(found, expected)


def mismatch(found: np.dtype[Any], layout: Layout, *, where: str) -> PayloadDtypeMismatch:
    """The error for an array of ``found`` that may not carry ``layout`` (at ``where``)."""
    expected = layout.element_dtype
    assert expected is not None
    return PayloadDtypeMismatch(
        f"{where}: layout {layout.name!r} holds {expected.name} values, found a payload array "
        f"of {found.name} (its bytes would be read as {expected.name}); convert it "
        f"(.astype(np.{expected.name})), or hand in its bytes as uint8 if they already are "
        f"{expected.name}"
    )


def batch_mismatch(
    found: np.dtype[Any],
    layout_ids: np.ndarray[Any, Any],
    schema: RecordSchema,
    where: Callable[[int], str],
) -> PayloadDtypeMismatch | None:
    """The error for a batch's payload array of ``found`` when a layout its
    records name (``layout_ids``, already checked to exist) holds other
    values, naming the first such record (``where(i)``); else None."""
    if is_raw(found) or not len(layout_ids):
        return None
    first = layout_ids[0]
    ids = [first] if (layout_ids == first).all() else np.unique(layout_ids).tolist()
    for layout_id in ids:
        layout = schema.by_id(int(layout_id))
        if not fits(found, layout, single=False):
            return mismatch(found, layout, where=where(int(np.argmax(layout_ids == layout_id))))
    return None


def single_payload(payload: Any, layout: Layout, *, hook: str) -> Any:
    """``payload`` for one record of ``layout``: itself, converted exactly, or raise."""
    if not isinstance(payload, np.ndarray):
        return payload
    if not fits(payload.dtype, layout, single=True):
        raise mismatch(payload.dtype, layout, where=f"hook {hook!r}")
    expected = layout.element_dtype
    if expected is not None and not is_raw(payload.dtype) and payload.dtype != expected:
        return np.ascontiguousarray(payload, dtype=expected)
    return payload
