"""The three route kinds ``inference_cost.py`` measures beside raw capture.

Issue #13's ClickHouse target is for a capture with a forward, a stateless
and a stateful route, so the bench's ``*_routes`` variants route the hooks
it binds as a user capturing activations would:

- ``raw`` (forward): every hooked output, untouched -> ``raw_acts``;
- ``norms`` (stateless): the first pattern's outputs (attention / query
  projections) -> one row per record: its token count and mean token L2 norm;
- ``summary`` (stateful, keyed by sequence): the last pattern's outputs
  (block / layer outputs) folded per sequence in tumbling windows of
  :data:`WINDOW` records -> one row per closed window (records, tokens, mean
  and max token norm).

Both processors take all of a batch's tokens in one gather and reduce them
with numpy, no per-record Python (as ``bench/server_capture.py``'s do).
Registered per hidden width (the bench's models differ), at first use.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from taproute.native import StateRegion
from taproute.service import (
    Layout,
    Records,
    RecordSchema,
    Route,
    RoutingConfig,
    SlotSpec,
    stateful_processor,
    stateless_processor,
)
from taproute.service.signals.common import all_tokens, hooks_and_layers, tumbling_windows

ACTS = Layout("acts", [("values", "Array(Float32)")])
TOKEN_NORMS = Layout(
    "token_norms",
    [
        ("hook", "LowCardinality(String)"),
        ("key", "Int64"),
        ("step", "Int64"),
        ("tokens", "UInt32"),
        ("norm_mean", "Float32"),
    ],
)
KEY_NORMS = Layout(
    "key_norms",
    [
        ("key", "Int64"),
        ("window", "UInt32"),
        ("records", "UInt32"),
        ("tokens", "UInt32"),
        ("norm_mean", "Float64"),
        ("norm_max", "Float64"),
    ],
)
SCHEMA = RecordSchema([ACTS, TOKEN_NORMS, KEY_NORMS])
#: ClickHouse sink arguments: raw records and the processors' rows, in tables
#: of their own (in-process chDB holds one directory, shared with the bench's
#: raw-only variant).
TABLES: dict[str, Any] = {
    "raw": ["acts"],
    "rows": ["token_norms", "key_norms"],
    "raw_table": "routed_raw_{layout}",
    "rows_table": "routed_{layout}",
}
#: Table of each layout, as :data:`TABLES` names them.
TABLE_OF = {"acts": "routed_raw_acts", "token_norms": "routed_token_norms",
            "key_norms": "routed_key_norms"}  # fmt: skip

#: Records per sequence in one summary window.
WINDOW = 16
#: Sequence keys map to ``key % KEY_SLOTS``.
KEY_SLOTS = 1024

_REGISTERED: dict[int, tuple[str, str]] = {}


def _token_norms(records: Records, width: int, where: str) -> tuple[Any, Any, Any]:
    """Each token's L2 norm, each record's token count and first token's index."""
    vectors, counts = all_tokens(records, width, where=where)
    # float32 products summed in float32 (SIMD; 256 terms lose nothing a norm
    # needs), widened once: einsum with dtype=float64 casts element by element,
    # about 6x slower.
    norms = np.sqrt(np.einsum("ij,ij->i", vectors, vectors)).astype(np.float64)
    first = np.cumsum(counts) - counts
    return norms, counts, first


def _reduce(
    norms: npt.NDArray[np.float64],
    counts: npt.NDArray[np.int64],
    first: npt.NDArray[np.int64],
    ufunc: np.ufunc,
) -> npt.NDArray[np.float64]:
    """``ufunc`` over each record's tokens (0 for a record without any)."""
    out = np.zeros(len(counts))
    some = counts > 0
    if some.any():
        out[some] = ufunc.reduceat(norms, first[some])
    return out


def _sequence(descriptors: npt.NDArray[np.void]) -> npt.NDArray[np.int64]:
    """A record's summary slot: its sequence key modulo :data:`KEY_SLOTS`."""
    slots: npt.NDArray[np.int64] = descriptors["key"] % KEY_SLOTS
    return slots


def register(width: int) -> tuple[str, str]:
    """The (stateless, stateful) processor names for hidden width ``width``."""
    if width in _REGISTERED:
        return _REGISTERED[width]
    stateless, stateful = f"cost.token_norms_{width}", f"cost.key_norms_{width}"

    def token_norms(records: Records) -> npt.NDArray[np.void]:
        norms, counts, first = _token_norms(records, width, stateless)
        rows = np.empty(len(records), dtype=TOKEN_NORMS.dtype)
        desc = records.descriptors
        rows["hook"] = hooks_and_layers(records)[0]
        rows["key"] = desc["key"]
        rows["step"] = desc["step"]
        rows["tokens"] = counts
        rows["norm_mean"] = _reduce(norms, counts, first, np.add) / np.maximum(counts, 1)
        return rows

    def key_norms(
        records: Records, keys: npt.NDArray[np.int64], state: StateRegion
    ) -> npt.NDArray[np.void] | None:
        # Slot: [records in the open window, window number, tokens, Σ norm, max norm].
        norms, counts, first = _token_norms(records, width, stateful)
        sums = _reduce(norms, counts, first, np.add)
        peaks = _reduce(norms, counts, first, np.maximum)
        desc = records.descriptors

        def add(slot: npt.NDArray[np.float64], part: npt.NDArray[np.intp]) -> None:
            slot[2] += counts[part].sum()
            slot[3] += sums[part].sum()
            slot[4] = max(slot[4], peaks[part].max())

        def row(slot: npt.NDArray[np.float64], record: int) -> npt.NDArray[np.void]:
            out = np.empty(1, dtype=KEY_NORMS.dtype)
            out[0] = (
                int(desc["key"][record]),
                int(slot[1]),
                int(slot[0]),
                int(slot[2]),
                slot[3] / max(slot[2], 1.0),
                slot[4],
            )
            return out

        return tumbling_windows(keys, state.slots, WINDOW, add, row)

    stateless_processor(stateless, input="acts", output="token_norms")(token_norms)
    stateful_processor(
        stateful,
        key=_sequence,
        key_range=KEY_SLOTS,
        slot=SlotSpec((5,), "float64"),
        input="acts",
        output="key_norms",
    )(key_norms)
    _REGISTERED[width] = (stateless, stateful)
    return stateless, stateful


def routes(patterns: list[str], width: int, destination: str = "clickhouse") -> RoutingConfig:
    """Raw capture of every pattern's hooks, token norms of the first pattern's,
    per-sequence summaries of the last one's."""
    stateless, stateful = register(width)
    return RoutingConfig(
        [
            Route("raw", list(patterns), destination),
            Route(
                "norms",
                [patterns[0]],
                destination,
                mode="stateless",
                processor=stateless,
                workers=2,
            ),
            Route(
                "summary",
                [patterns[-1]],
                destination,
                mode="stateful",
                processor=stateful,
                workers=2,
            ),
        ]
    )
