"""A synthetic model server: the layouts, processors and routes the demo uses,
and a producer that captures fake attention outputs.

Each "forward pass" yields, per layer, one query projection of shape
``(tokens, heads * head_dim)`` as one record; routes then keep the raw
captures, compute per-head norms (stateless) and a per-layer running
mean/variance of every hidden unit (stateful, Welford).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from taproute.native import StateRegion, make_descriptors
from taproute.routing import (
    Layout,
    Records,
    RecordSchema,
    Route,
    RoutingConfig,
    SlotSpec,
    stateful_processor,
    stateless_processor,
)

LAYERS = 6
HEADS = 12
HEAD_DIM = 32
HIDDEN = HEADS * HEAD_DIM
TOKENS = 16

QUERY = Layout("query", [("values", "Array(Float32)", (TOKENS, HIDDEN))])
HEAD_NORMS = Layout(
    "head_norms",
    [("request", "Int64"), ("layer", "UInt16"), ("norms", "Array(Float32)", (HEADS,))],
)
UNIT_STATS = Layout(
    "unit_stats",
    [
        ("layer", "UInt16"),
        ("count", "UInt64"),
        ("mean", "Array(Float64)", (HIDDEN,)),
        ("variance", "Array(Float64)", (HIDDEN,)),
    ],
)
SCHEMA = RecordSchema([QUERY, HEAD_NORMS, UNIT_STATS])


def layer_of(descriptors: npt.NDArray[np.void]) -> npt.NDArray[np.int64]:
    """The demo's producer stamps the layer index into ``step``'s high bits."""
    return (descriptors["step"] >> 32).astype(np.int64)


@stateless_processor("demo.head_norms", input="query", output="head_norms")
def head_norms(records: Records) -> npt.NDArray[np.void]:
    """Mean L2 norm of each head's query vectors over the tokens of a record."""
    values = records.rows()["values"].reshape(len(records), TOKENS, HEADS, HEAD_DIM)
    rows = np.empty(len(records), dtype=HEAD_NORMS.dtype)
    rows["request"] = records.descriptors["key"]
    rows["layer"] = layer_of(records.descriptors)
    rows["norms"] = np.linalg.norm(values, axis=-1).mean(axis=1)
    return rows


@stateful_processor(
    "demo.unit_stats",
    key=layer_of,
    key_range=LAYERS,
    slot=SlotSpec((3, HIDDEN), "float64"),  # count, mean, M2 per hidden unit
    input="query",
    output="unit_stats",
)
def unit_stats(
    records: Records, keys: npt.NDArray[np.int64], state: StateRegion
) -> npt.NDArray[np.void]:
    """Welford running mean and variance of each hidden unit, per layer."""
    values = records.rows()["values"].astype(np.float64)
    for key, tokens in zip(keys.tolist(), values, strict=True):
        count, mean, m2 = state.slots[key]  # views into this key's slot
        # Merge one record's tokens at once (Chan et al.'s parallel Welford update).
        n_b = tokens.shape[0]
        mean_b = tokens.mean(axis=0)
        m2_b = ((tokens - mean_b) ** 2).sum(axis=0)
        n = count + n_b
        delta = mean_b - mean
        mean += delta * n_b / n
        m2 += m2_b + delta**2 * count * n_b / n
        count[:] = n
    layers = np.unique(keys)
    rows = np.empty(len(layers), dtype=UNIT_STATS.dtype)
    rows["layer"] = layers
    rows["count"] = state.slots[layers, 0, 0]
    rows["mean"] = state.slots[layers, 1]
    rows["variance"] = state.slots[layers, 2] / np.maximum(state.slots[layers, 0], 1)
    return rows


def demo_routes(raw_destination: str, stats_destination: str) -> RoutingConfig:
    """Raw captures forwarded; per-head norms and per-layer unit stats computed."""
    return RoutingConfig(
        [
            Route("raw_query", "layers.*.attn.q", raw_destination),
            Route(
                "head_norms",
                "layers.*.attn.q",
                stats_destination,
                mode="stateless",
                processor="demo.head_norms",
                workers=2,
            ),
            Route(
                "unit_stats",
                "layers.*.attn.q",
                stats_destination,
                mode="stateful",
                processor="demo.unit_stats",
                workers=2,
            ),
        ]
    )


def forward_pass(
    rng: np.random.Generator, request: int, output_ids: list[int]
) -> tuple[npt.NDArray[np.void], npt.NDArray[np.float32]]:
    """One request's captures: a descriptor per layer and one payload buffer."""
    scale = 1.0 + np.arange(LAYERS, dtype=np.float32)[:, None, None] / LAYERS
    payload = (rng.standard_normal((LAYERS, TOKENS, HIDDEN), dtype=np.float32) * scale).astype(
        np.float32
    )
    descriptors = make_descriptors(
        output_ids,
        QUERY.dtype.itemsize,
        layout_ids=SCHEMA.layout_id("query"),
        keys=request,
        steps=np.arange(LAYERS, dtype=np.int64) << 32,
    )
    return descriptors, payload
