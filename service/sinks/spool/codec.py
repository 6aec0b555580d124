"""One batch as bytes in a spool frame, and back.

A :class:`~taproute.routing.batch.RecordBatch` is stored as its descriptors
(which carry each record's layout id) and the payload bytes they cover; a
:class:`~taproute.routing.batch.RowBatch` as its route, layout name, row
dtype and rows.  Encoding returns a list of buffers so the payload is written
from the producer's memory without a gather copy when the records cover it
in order (the common case).  Decoding returns batches whose memory belongs to
the decoded bytes (a spool read), never to the producer.

Output ids are a process's own (handed out in binding order), so a record
batch encoded with the producer's hook registry also stores the name,
layout and token shape of each hook its records came from
(``NAMED_RECORDS``); decoding with the registry of the process reading the
spool maps them to the ids it bound (binding a name it does not know yet),
so a restart that binds hooks in another order replays every record under
its own hook.  Frames written without a registry (and by earlier versions)
keep their ids as they are.
"""

from __future__ import annotations

import json
import pickle
import struct
from collections.abc import Sequence

import numpy as np

from taproute.native import DESCRIPTOR_DTYPE
from taproute.routing.batch import Batch, RecordBatch, RowBatch
from taproute.routing.hooks import HookRegistry

#: Body kinds (first byte of a frame's body).
RECORDS = 1
ROWS = 2
NAMED_RECORDS = 3  # RECORDS with the names of their hooks

_NAMED_HEAD = struct.Struct("<BQI")  # kind, descriptor count, JSON hooks length

_RECORDS_HEAD = struct.Struct("<BQ")  # kind, descriptor count
_ROWS_HEAD = struct.Struct("<BI")  # kind, JSON header length
_TOKEN = struct.Struct("<H")  # length of a deduplication token fixed before spooling
_COUNT = struct.Struct("<I")  # batches in the frame
_LENGTH = struct.Struct("<Q")  # bytes of one encoded batch


class SpoolDecodeError(ValueError):
    """A frame's body passed its checksum but is not a batch this version can read."""


def _contiguous(batch: RecordBatch) -> bool:
    d = batch.descriptors
    if len(d) == 0:
        return True
    lengths = d["length"]
    offsets = d["offset"]
    if int(offsets[0]) != 0:
        return False
    ends = offsets + lengths
    return bool(np.array_equal(offsets[1:], ends[:-1])) and int(ends[-1]) == len(batch.payload)


def encode(
    batches: Sequence[Batch], token: str | None = None, hooks: HookRegistry | None = None
) -> list[bytes | memoryview]:
    """The buffers of one frame body for ``batches`` (no copy of a contiguous payload).

    A frame holds the batches that are inserted together under one
    deduplication token.  ``token`` is that token when one was already used
    (batches tried on the memory path before they were spooled keep theirs,
    so a reply lost on that try is not a duplicate on replay).  ``hooks``:
    the producer's registry, whose names, layouts and token shapes of the
    records' hooks are stored beside them.
    """
    raw_token = (token or "").encode()
    out: list[bytes | memoryview] = [
        _TOKEN.pack(len(raw_token)) + raw_token + _COUNT.pack(len(batches))
    ]
    for batch in batches:
        parts = _encode_batch(batch, hooks)
        out.append(_LENGTH.pack(sum(memoryview(p).nbytes for p in parts)))
        out.extend(parts)
    return out


def _hook_names(descriptors: np.ndarray, hooks: HookRegistry) -> bytes | None:
    """JSON ``[[output_id, name, layout, token_shape], ...]`` of the bound
    hooks ``descriptors`` name; None when none of them is bound."""
    names = hooks.names()
    table = []
    for output_id in np.unique(descriptors["output_id"]).tolist():
        if 0 <= output_id < len(names):
            shape = hooks.token_shape_of(output_id)
            table.append(
                [
                    output_id,
                    names[output_id],
                    hooks.layout_of(output_id),
                    None if shape is None else list(shape),
                ]
            )
    return json.dumps(table).encode() if table else None


def _encode_batch(batch: Batch, hooks: HookRegistry | None) -> list[bytes | memoryview]:
    if isinstance(batch, RecordBatch):
        descriptors = batch.descriptors
        if _contiguous(batch):
            payload: memoryview = batch.payload.data
        else:
            # A selection of a shared buffer: gather only the covered bytes,
            # rewriting offsets, so a replay never holds the whole original.
            lengths = descriptors["length"].astype(np.int64)
            chunks = [batch.payload_of(i) for i in range(len(descriptors))]
            payload = (np.concatenate(chunks) if chunks else np.empty(0, np.uint8)).data
            descriptors = descriptors.copy()
            offsets = np.zeros(len(lengths), np.int64)
            np.cumsum(lengths[:-1], out=offsets[1:])
            descriptors["offset"] = offsets
        raw = np.ascontiguousarray(descriptors).view(np.uint8).data
        named = None if hooks is None or len(descriptors) == 0 else _hook_names(descriptors, hooks)
        if named is None:
            return [_RECORDS_HEAD.pack(RECORDS, len(descriptors)), raw, payload]
        return [_NAMED_HEAD.pack(NAMED_RECORDS, len(descriptors), len(named)), named, raw, payload]
    rows = batch.rows
    head = json.dumps({"route": batch.route, "layout": batch.layout_name}).encode()
    # Rows with object columns (String, variable arrays) have no flat bytes:
    # numpy's own pickle of the array keeps them exactly (local, trusted file).
    body = pickle.dumps(rows, protocol=5)
    return [_ROWS_HEAD.pack(ROWS, len(head)), head, body]


def decode(
    body: bytes | memoryview, hooks: HookRegistry | None = None
) -> tuple[list[Batch], str | None]:
    """The batches one frame body holds (their memory is ``body``'s) and its fixed token.

    ``hooks``: the reading process's registry; records stored with their
    hooks' names get the output ids these names have there (bound now when
    they are not yet)."""
    view = memoryview(body)
    if len(view) < _TOKEN.size:
        raise SpoolDecodeError("frame body shorter than its token length")
    (token_len,) = _TOKEN.unpack_from(view)
    at = _TOKEN.size + token_len
    token = bytes(view[_TOKEN.size : at]).decode() or None
    (count,) = _COUNT.unpack_from(view, at)
    at += _COUNT.size
    batches = []
    for _ in range(count):
        (length,) = _LENGTH.unpack_from(view, at)
        at += _LENGTH.size
        if at + length > len(view):
            raise SpoolDecodeError(f"frame says a batch of {length} bytes, body too short")
        batches.append(_decode_batch(view[at : at + length], hooks))
        at += length
    return batches, token


def _rebind(descriptors: np.ndarray, named: bytes, hooks: HookRegistry | None) -> np.ndarray:
    """``descriptors`` with the output ids ``hooks`` gives the names stored
    with them (a copy; as they are without a registry)."""
    try:
        table = json.loads(named)
    except ValueError as exc:
        raise SpoolDecodeError(f"frame's hook names are not JSON: {exc}") from None
    if hooks is None:
        return descriptors
    ids = descriptors["output_id"]
    mapped = ids.copy()
    for output_id, name, layout, shape in table:
        now = hooks.id_of(name)
        if now is None:
            now = hooks.bind(name, layout=layout)
            if shape is not None:
                hooks.set_token_shape(now, tuple(shape))
        elif shape is not None and hooks.token_shape_of(now) is None:
            hooks.set_token_shape(now, tuple(shape))
        if now != output_id:
            mapped[ids == output_id] = now
    if np.array_equal(mapped, ids):
        return descriptors
    rebound = descriptors.copy()
    rebound["output_id"] = mapped
    return rebound


def _decode_batch(view: memoryview, hooks: HookRegistry | None) -> Batch:
    if len(view) < 1:
        raise SpoolDecodeError("empty frame body")
    kind = view[0]
    if kind in (RECORDS, NAMED_RECORDS):
        named = b""
        if kind == RECORDS:
            _, count = _RECORDS_HEAD.unpack_from(view)
            start = _RECORDS_HEAD.size
        else:
            _, count, names_len = _NAMED_HEAD.unpack_from(view)
            named = bytes(view[_NAMED_HEAD.size : _NAMED_HEAD.size + names_len])
            start = _NAMED_HEAD.size + names_len
        end = start + count * DESCRIPTOR_DTYPE.itemsize
        if end > len(view):
            raise SpoolDecodeError(f"frame says {count} descriptors, body too short")
        descriptors = np.frombuffer(view[start:end], dtype=DESCRIPTOR_DTYPE)
        if named:
            descriptors = _rebind(descriptors, named, hooks)
        return RecordBatch.from_buffer(descriptors, view[end:])
    if kind == ROWS:
        _, head_len = _ROWS_HEAD.unpack_from(view)
        start = _ROWS_HEAD.size
        head = json.loads(bytes(view[start : start + head_len]))
        rows = pickle.loads(view[start + head_len :])
        return RowBatch(route=head["route"], layout_name=head["layout"], rows=rows)
    raise SpoolDecodeError(
        f"unknown frame kind {kind} (expected {RECORDS}, {ROWS} or {NAMED_RECORDS})"
    )


__all__ = ["SpoolDecodeError", "decode", "encode"]
