"""The record descriptor: one fixed numpy structured dtype for every record.

A batch's descriptors are one array of :data:`DESCRIPTOR_DTYPE`; the payload
bytes of record ``i`` are ``payload[offset[i] : offset[i] + length[i]]`` of the
batch's one shared buffer.
"""

from __future__ import annotations

import operator
import time

import numpy as np
import numpy.typing as npt

#: output_id: which hook produced the record (from ``bind_hook``);
#: layout_id: index of the payload's layout in the ``RecordSchema``;
#: flags: reserved, 0;
#: key: request / sequence id (stateful routes derive their key from it);
#: step: decode step or iteration; seq: producer sequence number;
#: timestamp_ns: capture time, ns since the epoch;
#: offset, length: the payload's byte range in the batch buffer.
DESCRIPTOR_DTYPE: np.dtype[np.void] = np.dtype(
    [
        ("output_id", "<u4"),
        ("layout_id", "<u2"),
        ("flags", "<u2"),
        ("key", "<i8"),
        ("step", "<i8"),
        ("seq", "<i8"),
        ("timestamp_ns", "<i8"),
        ("offset", "<i8"),
        ("length", "<i8"),
    ]
)

IntArrayLike = int | npt.ArrayLike


class DescriptorFieldError(ValueError):
    """A descriptor field's value is not an integer its column can hold.

    Raised where the value is given (``submit``, ``make_descriptors``, a
    trace), so a bad field is refused before anything is accepted, instead of
    failing later and taking the records coalesced with it down.
    """


def _field_bounds(name: str) -> tuple[int, int]:
    info = np.iinfo(DESCRIPTOR_DTYPE.fields[name][0])  # type: ignore[index]
    return int(info.min), int(info.max)


#: Inclusive (min, max) of each integer descriptor field, from the dtype itself.
FIELD_BOUNDS: dict[str, tuple[int, int]] = {
    name: _field_bounds(name) for name in DESCRIPTOR_DTYPE.names or ()
}
_INT64_MIN, _INT64_MAX = FIELD_BOUNDS["key"]


def check_int64(name: str, value: object) -> int:
    """``value`` as an int if it fits the int64 descriptor field ``name``; else raise.

    The fast path (a plain int in range) is two comparisons: single-record
    ``submit`` calls this per field.
    """
    if type(value) is int and _INT64_MIN <= value <= _INT64_MAX:
        return value
    return check_field(name, value)


def check_field(name: str, value: object) -> int:
    """``value`` as an int if the descriptor field ``name`` can hold it; else raise
    :class:`DescriptorFieldError` naming the field, the value and the range."""
    low, high = FIELD_BOUNDS[name]
    if isinstance(value, bool | np.bool_):
        raise DescriptorFieldError(f"{name} must be an integer, got a bool ({value!r})")
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise DescriptorFieldError(
            f"{name} must be an integer, got {type(value).__name__} ({value!r})"
        ) from None
    if not low <= number <= high:
        raise DescriptorFieldError(f"{name}={number} is outside its range [{low}, {high}]")
    return number


def _checked(name: str, value: IntArrayLike) -> IntArrayLike:
    """``value`` unchanged if every element fits field ``name``; else raise.

    Arrays whose dtype already casts safely cost nothing; only wider or
    unsigned integer arrays are scanned (min/max), and only once.
    """
    if np.ndim(value) == 0:
        return check_field(name, value.item() if isinstance(value, np.ndarray) else value)
    array = np.asarray(value)
    if array.size == 0:  # an empty list is float64 to numpy; there is nothing to check
        return array
    target = DESCRIPTOR_DTYPE.fields[name][0]  # type: ignore[index]
    if array.dtype.kind == "O":  # Python ints too wide for int64, or mixed objects
        return np.array([check_field(name, item) for item in array.ravel()], dtype=np.int64)
    if array.dtype.kind not in "iu":
        raise DescriptorFieldError(f"{name} must be integers, got an array of {array.dtype}")
    if not np.can_cast(array.dtype, target):
        low, high = FIELD_BOUNDS[name]
        found_low, found_high = int(array.min()), int(array.max())
        if found_low < low or found_high > high:
            bad = found_low if found_low < low else found_high
            raise DescriptorFieldError(f"{name}={bad} is outside its range [{low}, {high}]")
    return array


def _refuse_negative(column: npt.NDArray[np.int64], name: str, what: str) -> None:
    """Raise naming the first negative element of ``column`` (the argument ``name``)."""
    negative = np.flatnonzero(column < 0)
    if len(negative):
        index = int(negative[0])
        raise DescriptorFieldError(
            f"make_descriptors: {name}[{index}] = {int(column[index])}: {what} must be >= 0 "
            f"({len(negative)} negative of {len(column)})"
        )


def make_descriptors(
    output_ids: IntArrayLike,
    lengths: IntArrayLike,
    *,
    count: int | None = None,
    offsets: IntArrayLike | None = None,
    layout_ids: IntArrayLike = 0,
    keys: IntArrayLike = 0,
    steps: IntArrayLike = 0,
    seqs: IntArrayLike | None = None,
    timestamps_ns: IntArrayLike | None = None,
) -> npt.NDArray[np.void]:
    """Build a descriptor array, broadcasting scalars.

    ``count`` is the number of records (inferred from the first array argument
    when omitted).  ``offsets`` default to payloads packed back to back in
    order; ``seqs`` default to ``0..count-1``; ``timestamps_ns`` to now.
    A negative length or offset raises :class:`DescriptorFieldError` naming
    the argument and the record's index.
    """
    if count is None:
        for value in (output_ids, lengths, keys, steps, layout_ids):
            if np.ndim(value) > 0:
                count = len(np.asarray(value))
                break
        else:
            count = 1
    if isinstance(count, bool) or not isinstance(count, int | np.integer) or count < 0:
        raise DescriptorFieldError(f"make_descriptors: count must be an int >= 0, got {count!r}")
    arguments: dict[str, IntArrayLike | None] = {
        "output_ids": output_ids,
        "lengths": lengths,
        "offsets": offsets,
        "layout_ids": layout_ids,
        "keys": keys,
        "steps": steps,
        "seqs": seqs,
        "timestamps_ns": timestamps_ns,
    }
    for name, given in arguments.items():
        if given is not None and np.ndim(given) > 0 and np.shape(given) != (count,):
            raise DescriptorFieldError(
                f"make_descriptors: {name} has shape {np.shape(given)}, expected ({count},) "
                "(one per record) or a scalar"
            )
    desc = np.zeros(count, dtype=DESCRIPTOR_DTYPE)
    desc["output_id"] = _checked("output_id", output_ids)
    desc["layout_id"] = _checked("layout_id", layout_ids)
    desc["length"] = _checked("length", lengths)
    _refuse_negative(desc["length"], "lengths", "a payload length")
    if offsets is None:
        lengths_arr = desc["length"]
        desc["offset"][1:] = np.cumsum(lengths_arr[:-1])
        # Lengths are >= 0, so a running sum past int64 first shows as a negative.
        wrapped = np.flatnonzero(desc["offset"] < 0)
        if len(wrapped):
            raise DescriptorFieldError(
                f"make_descriptors: offsets[{int(wrapped[0])}]: the payloads packed back to "
                f"back overflow int64 (lengths sum past {_INT64_MAX}); pass offsets"
            )
    else:
        desc["offset"] = _checked("offset", offsets)
        _refuse_negative(desc["offset"], "offsets", "a payload offset")
    desc["key"] = _checked("key", keys)
    desc["step"] = _checked("step", steps)
    desc["seq"] = np.arange(count) if seqs is None else _checked("seq", seqs)
    desc["timestamp_ns"] = (
        time.time_ns() if timestamps_ns is None else _checked("timestamp_ns", timestamps_ns)
    )
    return desc
