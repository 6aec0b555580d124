"""RecordSchema: every layout taproute knows, by name and by id.

A record's descriptor carries a ``layout_id``; the schema turns it back into a
:class:`~taproute.routing.layout.Layout`.  One schema covers payload layouts
(what hooks capture) and output layouts (what processors return).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs
import numpy as np
import numpy.typing as npt

from taproute.routing.errors import (
    ConfigError,
    LayoutError,
    PayloadSizeMismatch,
    UnknownLayout,
)
from taproute.routing.layout import Layout

IntArray = npt.NDArray[np.int64]


def _payload_rules(layouts: tuple[Layout, ...]) -> tuple[IntArray, IntArray, IntArray]:
    fixed = np.zeros(len(layouts), dtype=np.int64)
    prefix = np.zeros(len(layouts), dtype=np.int64)
    element = np.zeros(len(layouts), dtype=np.int64)
    for i, layout in enumerate(layouts):
        try:
            layout.check_payload_layout()
        except LayoutError:
            fixed[i] = -1
            continue
        tail = layout.tail
        if tail is None:
            fixed[i] = layout.dtype.itemsize
        else:
            prefix[i] = layout.prefix_size
            element[i] = tail.element_dtype.itemsize
    return fixed, prefix, element


@attrs.frozen
class SizeRule:
    """What size one record's payload of a layout may have.

    ``fixed`` bytes exactly, or (``fixed`` 0) ``prefix`` bytes followed by
    whole ``element``-byte tail elements.  A plain tuple view, :attr:`parts`,
    is what the runtime caches per hook for its single-record fast path.
    """

    layout_id: int
    layout: str
    fixed: int
    prefix: int = 0
    element: int = 0

    @property
    def parts(self) -> tuple[int, int, int, int]:
        """(layout_id, fixed, prefix, element): the rule as plain ints."""
        return (self.layout_id, self.fixed, self.prefix, self.element)

    def fits(self, size: int) -> bool:
        """True when a payload of ``size`` bytes is one record of this layout."""
        return fits(self.fixed, self.prefix, self.element, size)

    def check(self, size: int, *, hook: str) -> None:
        """Raise :class:`PayloadSizeMismatch` unless ``size`` fits (``hook`` names the source)."""
        if not self.fits(size):
            raise self.mismatch(size, hook=hook)

    def mismatch(self, size: int, *, hook: str) -> PayloadSizeMismatch:
        """The error for a payload of ``size`` bytes that does not fit."""
        if self.fixed:
            expected = f"{self.fixed} bytes"
        elif self.prefix:
            expected = f"{self.prefix} bytes then a multiple of {self.element}"
        else:
            expected = f"a multiple of {self.element} bytes"
        return PayloadSizeMismatch(
            f"hook {hook!r}: payload of {size} bytes does not fit layout {self.layout!r} "
            f"(expected {expected})"
        )


def fits(fixed: int, prefix: int, element: int, size: int) -> bool:
    """The single-record size rule on plain ints (see :class:`SizeRule`)."""
    if fixed:
        return size == fixed
    if element:
        return size >= prefix and (size - prefix) % element == 0
    return True


def _to_layouts(value: Iterable[Layout] | Mapping[str, Layout]) -> tuple[Layout, ...]:
    if isinstance(value, Layout) or not isinstance(value, Iterable):
        raise ConfigError(
            "RecordSchema takes a list of Layout objects (RecordSchema([Layout(...), ...])), "
            f"found {type(value).__name__}"
        )
    layouts = tuple(value.values() if isinstance(value, Mapping) else value)
    for i, layout in enumerate(layouts):
        if not isinstance(layout, Layout):  # a name, a tuple: AttributeError 'name' otherwise
            raise ConfigError(
                f"RecordSchema: layouts[{i}] must be a Layout (Layout(name, columns)), "
                f"found {type(layout).__name__} {layout!r:.60}"
            )
    return layouts


@attrs.frozen
class RecordSchema:
    """Named layouts; a layout's id is its position in ``layouts``."""

    layouts: tuple[Layout, ...] = attrs.field(converter=_to_layouts)
    _by_name: dict[str, int] = attrs.field(init=False, repr=False, eq=False)
    #: Per layout id: (fixed payload size or 0 for a variable tail or -1 for
    #: "not a payload layout", tail prefix bytes, tail element bytes) as three
    #: int64 arrays, the form the native batch check reads.
    payload_rules: tuple[IntArray, IntArray, IntArray] = attrs.field(
        init=False, repr=False, eq=False
    )

    def __attrs_post_init__(self) -> None:
        by_name: dict[str, int] = {}
        for i, layout in enumerate(self.layouts):
            if layout.name in by_name:
                raise ConfigError(f"RecordSchema: duplicate layout name {layout.name!r}")
            by_name[layout.name] = i
        if len(self.layouts) > 0xFFFF:
            raise ConfigError("RecordSchema: at most 65535 layouts (layout_id is 16-bit)")
        object.__setattr__(self, "_by_name", by_name)
        object.__setattr__(self, "payload_rules", _payload_rules(self.layouts))

    def layout(self, name: str) -> Layout:
        """The layout called ``name``."""
        return self.layouts[self.layout_id(name)]

    def layout_id(self, name: str) -> int:
        """The id records of layout ``name`` carry in their descriptor."""
        try:
            return self._by_name[name]
        except KeyError:
            raise UnknownLayout(
                f"unknown layout {name!r}; the schema defines {sorted(self._by_name)}"
            ) from None

    def by_id(self, layout_id: int) -> Layout:
        """The layout with id ``layout_id``."""
        if not 0 <= layout_id < len(self.layouts):
            raise UnknownLayout(
                f"unknown layout_id {layout_id}; the schema has ids 0..{len(self.layouts) - 1}"
            )
        return self.layouts[layout_id]

    def size_rule(self, layout_id: int) -> SizeRule:
        """The size one record of layout ``layout_id`` must have."""
        layout = self.by_id(layout_id)
        tail = layout.tail
        if tail is None:
            return SizeRule(layout_id, layout.name, layout.dtype.itemsize)
        return SizeRule(layout_id, layout.name, 0, layout.prefix_size, tail.element_dtype.itemsize)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name


def expect_schema(value: object, where: str) -> RecordSchema:
    """``value`` if it is a :class:`RecordSchema`, else a ``TypeError`` naming ``where``
    (e.g. a path and a schema handed in the wrong order)."""
    if not isinstance(value, RecordSchema):
        raise TypeError(
            f"{where}: schema must be a RecordSchema, found {type(value).__name__} ({value!r:.80})"
        )
    return value
