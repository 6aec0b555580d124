"""What the signal processors share: per-hook keys, layer numbers from hook
names, stacked payloads, and tumbling windows counted in records."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from taproute.native import gather_ranges
from taproute.routing import ConfigError, InvalidInput, Layout, Records

#: Stateful signal routes keep one slot per hook (``output_id``); hooks bound
#: with ids at or past this are refused by the route (``policy_invalid``).
DEFAULT_KEY_RANGE = 256

_NUMBER = re.compile(r"\d+")


def hook_key(descriptors: npt.NDArray[np.void]) -> npt.NDArray[np.int64]:
    """Key of a per-hook state slot: the record's ``output_id`` (one hook = one layer)."""
    return descriptors["output_id"].astype(np.int64)


def layer_of(hook: str) -> int:
    """The layer a hook belongs to: the first integer in its name (-1 if none).

    ``encoder.layer.3.attention.self.qk`` -> 3, ``model.layers.11.mlp.router`` -> 11.
    """
    match = _NUMBER.search(hook)
    return int(match.group()) if match else -1


def hooks_and_layers(
    records: Records, index: npt.NDArray[np.intp] | None = None
) -> tuple[npt.NDArray[np.object_], npt.NDArray[np.int16]]:
    """Hook name and layer of each record (or of ``records[index]``), one lookup per hook."""
    ids = records.descriptors["output_id"]
    if index is not None:
        ids = ids[index]
    unique, inverse = np.unique(ids, return_inverse=True)
    firsts = [int(np.flatnonzero(records.descriptors["output_id"] == u)[0]) for u in unique]
    names = np.array([records.hook_name(i) for i in firsts], dtype=object)
    layers = np.array([layer_of(str(n)) for n in names], dtype=np.int16)
    return names[inverse], layers[inverse]


def token_groups(
    records: Records, width: int, *, where: str
) -> Iterator[tuple[npt.NDArray[np.intp], npt.NDArray[np.generic]]]:
    """Records grouped by token count: ``(indices, values[n, tokens, width])`` per group.

    One gather of token rows per group (no per-record Python).  A payload that
    is not a whole number of ``width``-value tokens raises :class:`InvalidInput`.
    """
    flat, tokens = all_tokens(records, width, where=where)
    first = np.concatenate(([0], np.cumsum(tokens)[:-1]))
    for count in np.unique(tokens):
        index = np.flatnonzero(tokens == count)
        rows = first[index][:, None] + np.arange(int(count))
        yield index, flat[rows]


def window_segments(seen: int, count: int, window: int) -> Iterator[tuple[int, int, bool]]:
    """Split ``count`` new records of one key into tumbling-window segments.

    ``seen`` records of the current window came before.  Yields ``(start,
    stop, closes)``: records ``[start, stop)`` belong to one window, and
    ``closes`` says whether that window is complete after them.
    """
    start = 0
    while start < count:
        room = window - seen
        stop = min(count, start + room)
        yield start, stop, stop - start == room
        seen = 0
        start = stop


def keys_in_order(keys: npt.NDArray[np.int64]) -> Iterator[tuple[int, npt.NDArray[np.intp]]]:
    """Each distinct key and the indices of its records, in arrival order."""
    for key in np.unique(keys):
        yield int(key), np.flatnonzero(keys == key)


#: Adds records ``part`` (indices into the batch) to one key's slot.
AddToWindow = Callable[[npt.NDArray[Any], npt.NDArray[np.intp]], None]

#: The row of a key's closed window, from its slot and one of the key's records.
WindowRow = Callable[[npt.NDArray[Any], int], npt.NDArray[np.void]]


def tumbling_windows(
    keys: npt.NDArray[np.int64],
    slots: npt.NDArray[Any],
    window: int,
    add: AddToWindow,
    row: WindowRow,
) -> npt.NDArray[np.void] | None:
    """Feed each key's records, in arrival order, into its slot in tumbling
    windows of ``window`` records; return the rows of the windows that closed
    (None: none closed).

    A slot starts with the window bookkeeping: ``slot[0]`` counts the records
    of the open window, ``slot[1]`` numbers the windows.  ``add(slot, part)``
    adds a segment of records to the slot's sums; when a window closes,
    ``row(slot, first)`` builds its row (``first``: a record of the key, for
    its hook) and the slot is cleared for the next window.
    """
    out: list[npt.NDArray[np.void]] = []
    for key, index in keys_in_order(keys):
        slot = slots[key]
        for start, stop, closes in window_segments(int(slot[0]), len(index), window):
            part = index[start:stop]
            slot[0] += len(part)
            add(slot, part)
            if closes:
                out.append(row(slot, int(index[0])))
                number = slot[1]
                slot[:] = 0
                slot[1] = number + 1
    return np.concatenate(out) if out else None


@attrs.frozen
class Registered:
    """What one ``register(config)`` call added: processor names, the input
    layout they read and the output layouts they write (add both to your
    :class:`~taproute.routing.RecordSchema`)."""

    processors: tuple[str, ...]
    input: Layout
    outputs: tuple[Layout, ...]

    @property
    def layouts(self) -> tuple[Layout, ...]:
        """Input and output layouts together."""
        return (self.input, *self.outputs)


def tail_layout(name: str, element: str = "Float32") -> Layout:
    """A capture layout: one variable-length ``Array`` column ``values``."""
    return Layout(name, [("values", f"Array({element})")])


def positive(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    """attrs validator: an int > 0."""
    if not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{attribute.name} must be a positive int, got {value!r}")


def all_tokens(
    records: Records, width: int, *, where: str
) -> tuple[npt.NDArray[np.generic], npt.NDArray[np.int64]]:
    """Every record's tokens in record order, ``[total_tokens, width]``, and each
    record's token count.  One vectorised gather (a view when the records lie
    back to back); a payload that is not whole tokens raises :class:`InvalidInput`."""
    desc = records.descriptors
    element = records.layout.columns[-1].element_dtype
    row_bytes = width * element.itemsize
    prefix = records.layout.prefix_size
    sizes = (desc["length"] - prefix).astype(np.int64)
    bad = np.flatnonzero(sizes % row_bytes)
    if len(bad):
        i = int(bad[0])
        raise InvalidInput(
            f"{where}: record {i} (key {int(desc['key'][i])}) has {int(sizes[i])} payload "
            f"bytes, not a whole number of {width}-value tokens ({row_bytes} bytes each)"
        )
    counts = sizes // row_bytes
    total = int(sizes.sum())
    payload = records.batch.payload
    starts = desc["offset"].astype(np.int64) + prefix
    if total == 0:
        return np.empty((0, width), dtype=element), counts
    if bool(np.all(starts[1:] == starts[:-1] + sizes[:-1])):
        first = int(starts[0])
        flat = payload[first : first + total]
    else:
        # Holes between records (a merged batch spanning a shared pool's
        # buffers, a prefix): one native memcpy per record.  An index of one
        # int64 per payload byte cost several times the processors' own work.
        source = np.ascontiguousarray(payload).reshape(-1).view(np.uint8)
        flat = gather_ranges(source, starts, sizes, total)  # both fresh, contiguous int64
    return flat.view(element).reshape(-1, width), counts


def token_ranges(
    starts: npt.NDArray[np.int64], counts: npt.NDArray[np.int64]
) -> npt.NDArray[np.int64]:
    """The indices ``starts[i] .. starts[i] + counts[i] - 1`` of every run, run
    after run: the token rows of a set of records, without a per-record loop."""
    total = int(counts.sum())
    run_start = np.cumsum(counts) - counts
    indices: npt.NDArray[np.int64] = np.repeat(starts - run_start, counts) + np.arange(total)
    return indices


def float_rows(values: npt.NDArray[np.generic]) -> npt.NDArray[Any]:
    """``values`` as a C-contiguous float32 or float64 array (what the native
    kernels take): float32/float64 as they are, anything else as float64."""
    if values.dtype not in (np.float32, np.float64):
        values = values.astype(np.float64)
    return np.ascontiguousarray(values)
