"""One batch as bytes in a spool frame, and back.

A :class:`~taproute.routing.batch.RecordBatch` is stored as its descriptors
(which carry each record's layout id) and the payload bytes they cover; a
:class:`~taproute.routing.batch.RowBatch` as its route, layout name, row
dtype and rows.  Encoding returns a list of buffers so the payload is written
from the producer's memory without a gather copy when the records cover it
in order (the common case).  Decoding returns batches whose memory belongs to
the decoded bytes (a spool read), never to the producer.
"""

from __future__ import annotations

import json
import pickle
import struct
from collections.abc import Sequence

import numpy as np

from taproute.native import DESCRIPTOR_DTYPE
from taproute.routing.batch import Batch, RecordBatch, RowBatch

#: Body kinds (first byte of a frame's body).
RECORDS = 1
ROWS = 2

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


def encode(batches: Sequence[Batch], token: str | None = None) -> list[bytes | memoryview]:
    """The buffers of one frame body for ``batches`` (no copy of a contiguous payload).

    A frame holds the batches that are inserted together under one
    deduplication token.  ``token`` is that token when one was already used
    (batches tried on the memory path before they were spooled keep theirs,
    so a reply lost on that try is not a duplicate on replay).
    """
    raw_token = (token or "").encode()
    out: list[bytes | memoryview] = [
        _TOKEN.pack(len(raw_token)) + raw_token + _COUNT.pack(len(batches))
    ]
    for batch in batches:
        parts = _encode_batch(batch)
        out.append(_LENGTH.pack(sum(memoryview(p).nbytes for p in parts)))
        out.extend(parts)
    return out


def _encode_batch(batch: Batch) -> list[bytes | memoryview]:
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
        return [
            _RECORDS_HEAD.pack(RECORDS, len(descriptors)),
            np.ascontiguousarray(descriptors).view(np.uint8).data,
            payload,
        ]
    rows = batch.rows
    head = json.dumps({"route": batch.route, "layout": batch.layout_name}).encode()
    # Rows with object columns (String, variable arrays) have no flat bytes:
    # numpy's own pickle of the array keeps them exactly (local, trusted file).
    body = pickle.dumps(rows, protocol=5)
    return [_ROWS_HEAD.pack(ROWS, len(head)), head, body]


def decode(body: bytes | memoryview) -> tuple[list[Batch], str | None]:
    """The batches one frame body holds (their memory is ``body``'s) and its fixed token."""
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
        batches.append(_decode_batch(view[at : at + length]))
        at += length
    return batches, token


def _decode_batch(view: memoryview) -> Batch:
    if len(view) < 1:
        raise SpoolDecodeError("empty frame body")
    kind = view[0]
    if kind == RECORDS:
        _, count = _RECORDS_HEAD.unpack_from(view)
        start = _RECORDS_HEAD.size
        end = start + count * DESCRIPTOR_DTYPE.itemsize
        if end > len(view):
            raise SpoolDecodeError(f"frame says {count} descriptors, body too short")
        descriptors = np.frombuffer(view[start:end], dtype=DESCRIPTOR_DTYPE)
        return RecordBatch.from_buffer(descriptors, view[end:])
    if kind == ROWS:
        _, head_len = _ROWS_HEAD.unpack_from(view)
        start = _ROWS_HEAD.size
        head = json.loads(bytes(view[start : start + head_len]))
        rows = pickle.loads(view[start + head_len :])
        return RowBatch(route=head["route"], layout_name=head["layout"], rows=rows)
    raise SpoolDecodeError(f"unknown frame kind {kind} (expected {RECORDS} or {ROWS})")


__all__ = ["SpoolDecodeError", "decode", "encode"]
