"""Narrowing a forward route's raw records from Float32 to BFloat16.

A route with ``narrow={"acts": "acts_bf16"}`` hands its destination the
records of layout ``acts`` (every column Float32) as records of layout
``acts_bf16`` (the same columns in BFloat16): half the bytes, stored in
ClickHouse ``BFloat16`` columns.  Each value is rounded to the nearest
bfloat16, ties to even (IEEE 754's default; ml_dtypes' cast, the same as
torch's ``.to(torch.bfloat16)``): 8 significant bits instead of 24, a
relative error of at most 2**-9, the same exponent range (no overflow, no
flush of subnormals; a finite value within half a bfloat16 step of the
largest rounds to infinity); NaN stays NaN (quiet, sign kept).

Narrowing makes a new, packed payload (one gather when the records are not
back to back, one cast, per batch; no per-record Python); records of other
layouts go on unnarrowed, sharing the original payload.  Checked when the
route is planned: the source layout has only Float32 columns and the target
the same columns in BFloat16.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import ml_dtypes
import numpy as np
import numpy.typing as npt

from taproute.native import gather_ranges
from taproute.routing.batch import RecordBatch
from taproute.routing.errors import ConfigError
from taproute.routing.layout import Column, Layout
from taproute.routing.schema import RecordSchema

_F32 = np.dtype("<f4")
_BF16 = np.dtype(ml_dtypes.bfloat16)


@attrs.frozen(eq=False)
class Narrowing:
    """Which layouts a route narrows, and into which (``table[source_id]`` is
    the target's layout id, -1 for a layout left as it is)."""

    pairs: tuple[tuple[str, str], ...]
    table: npt.NDArray[np.int32] = attrs.field(repr=False)

    @classmethod
    def build(cls, mapping: Mapping[str, str], schema: RecordSchema, *, where: str) -> Narrowing:
        """Check ``mapping`` (source layout -> BFloat16 twin) against ``schema``."""
        table = np.full(len(schema.layouts), -1, dtype=np.int32)
        for source_name, target_name in mapping.items():
            try:
                source, target = schema.layout(source_name), schema.layout(target_name)
            except ConfigError as exc:
                raise type(exc)(f"{where}, narrow: {exc}") from None
            _check_pair(source, target, where=f"{where}, narrow {source_name!r}")
            table[schema.layout_id(source_name)] = schema.layout_id(target_name)
        return cls(tuple(mapping.items()), table)

    def apply(self, batch: RecordBatch) -> list[RecordBatch]:
        """``batch`` as the route's destination gets it: the records of a
        narrowed layout in a new batch, the others (if any) sharing ``batch``'s
        payload; just ``[batch]`` when nothing in it is narrowed."""
        targets = self.table[batch.descriptors["layout_id"]]
        hit = targets >= 0
        if not hit.any():
            return [batch]
        if hit.all():
            return [narrow_batch(batch.descriptors, batch.payload, targets)]
        kept = batch.select(np.flatnonzero(~hit))
        narrowed = narrow_batch(batch.descriptors[hit], batch.payload, targets[hit])
        return [kept, narrowed]


def _check_pair(source: Layout, target: Layout, *, where: str) -> None:
    source.check_payload_layout()
    if len(source.columns) != len(target.columns):
        raise ConfigError(
            f"{where}: layout {target.name!r} has {len(target.columns)} columns, "
            f"{source.name!r} has {len(source.columns)}; a narrowed layout has the same columns"
        )
    for src, dst in zip(source.columns, target.columns, strict=True):
        if src.element_dtype != _F32:
            raise ConfigError(
                f"{where}: column {src.name!r} of {source.name!r} is {src.type}; narrowing "
                "takes layouts whose every column is Float32 (or Array(Float32))"
            )
        expected = Column(src.name, _bfloat16_type(src.type), src.shape)
        if (dst.name, dst.type.replace(" ", ""), dst.shape) != (
            expected.name,
            expected.type,
            expected.shape,
        ):
            raise ConfigError(
                f"{where}: layout {target.name!r} column {dst.name!r} {dst.type} "
                f"(shape {list(dst.shape)}): expected {expected.name!r} {expected.type} "
                f"(shape {list(expected.shape)}), the BFloat16 twin of {source.name!r}"
            )


def _bfloat16_type(ch_type: str) -> str:
    return ch_type.replace(" ", "").replace("Float32", "BFloat16")


def narrow_batch(
    descriptors: npt.NDArray[np.void], payload: npt.NDArray[np.uint8], targets: npt.ArrayLike
) -> RecordBatch:
    """A new batch of ``descriptors``' records with their Float32 values rounded
    to BFloat16, packed in record order, with layout ids ``targets``."""
    offsets = descriptors["offset"]
    lengths = descriptors["length"]
    total = int(lengths.sum())
    values = _float32_values(payload, offsets, lengths, total)
    with np.errstate(invalid="ignore"):  # NaN stays NaN; numpy warns about the cast
        narrowed = values.astype(_BF16)
    out = descriptors.copy()
    out["layout_id"] = targets
    out["length"] = lengths // 2
    out["offset"][0:1] = 0
    np.cumsum(out["length"][:-1], out=out["offset"][1:])
    return RecordBatch.from_buffer(out, narrowed)


def _float32_values(
    payload: npt.NDArray[np.uint8],
    offsets: npt.NDArray[np.int64],
    lengths: npt.NDArray[np.int64],
    total: int,
) -> npt.NDArray[np.float32]:
    """The records' bytes as Float32 values, in record order (a view when they
    are back to back, else one gather)."""
    if len(offsets) == 0:
        return np.empty(0, _F32)
    start = int(offsets[0])
    if bool(np.all(offsets[1:] == offsets[:-1] + lengths[:-1])):
        return payload[start : start + total].view(_F32)
    # One native memcpy per record, not an index of one int64 per byte.
    source = np.ascontiguousarray(payload).reshape(-1).view(np.uint8)
    gathered = gather_ranges(
        source,
        np.ascontiguousarray(offsets, dtype=np.int64),  # descriptor fields are strided views
        np.ascontiguousarray(lengths, dtype=np.int64),
        total,
    )
    return gathered.view(_F32)
