"""The demo's layouts, processors and routes (registered on import of this module).

Hooks capture every MiniLM layer's attention query/key projections and hidden
states; routes send

- every raw capture to ClickHouse (forward, no copy) -> table ``raw_activations``;
- the Q/K captures through a stateless per-head statistic -> ``head_norms``;
- the hidden states through a stateful per-layer Welford mean/variance of
  each hidden unit, keyed by layer -> ``unit_stats``;
- paired [Q | K] captures through ``signals.qk_spectra`` -> ``qk_spectra``, and
  the hidden states through TwoNN per layer -> ``intrinsic_dimension``.
"""

from __future__ import annotations

import re

import numpy as np
import numpy.typing as npt

from taproute.native import StateRegion
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
from taproute.service.signals import qk as signals_qk
from taproute.service.signals import twonn as signals_twonn

HIDDEN = 384
HEADS = 12
LAYERS = 6
MAX_HOOKS = 4096

ACTIVATIONS = Layout("activations", [("values", "Array(Float32)")])
HEAD_NORMS = Layout(
    "head_norms",
    [
        ("request", "Int64"),
        ("layer", "UInt16"),
        ("projection", "LowCardinality(String)"),
        ("tokens", "UInt32"),
        ("norms", "Array(Float32)", (HEADS,)),
    ],
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
# The signal processors (taproute.service.signals): Q/K spectra per record on
# paired [Q | K] captures, TwoNN intrinsic dimension per layer over windows of
# 16 sentences on the hidden states the demo already captures.
QK_SIGNALS = signals_qk.SIGNALS
DIMENSION = signals_twonn.register(
    signals_twonn.TwoNNConfig(input="activations", window=16, name="demo.intrinsic_dimension")
)
SIGNAL_QK_HOOK = "encoder.layer.{layer}.attention.qk"  # not matched by QK_HOOKS below

SCHEMA = RecordSchema(
    [
        ACTIVATIONS,
        HEAD_NORMS,
        UNIT_STATS,
        QK_SIGNALS.input,
        QK_SIGNALS.outputs[0],
        *DIMENSION.outputs,
    ]
)
TABLES = ("raw_activations", "head_norms", "unit_stats", "qk_spectra", "intrinsic_dimension")

QK_HOOKS = "encoder.layer.*.attention.self.[qk]*"
HIDDEN_HOOKS = "encoder.layer.?.output"  # not encoder.layer.N.attention.output

#: output_id -> layer index, filled as hooks are bound (-1: not a layer hook).
LAYER_OF_OUTPUT = np.full(MAX_HOOKS, -1, dtype=np.int64)
_LAYER = re.compile(r"encoder\.layer\.(\d+)\.")


def note_layer(name: str, output_id: int) -> None:
    """Remember which layer a bound hook belongs to (the stateful route's key)."""
    match = _LAYER.search(name)
    if match and output_id < MAX_HOOKS:
        LAYER_OF_OUTPUT[output_id] = int(match.group(1))


def layer_key(descriptors: npt.NDArray[np.void]) -> npt.NDArray[np.int64]:
    """Key of the per-layer state: the layer the record's hook belongs to."""
    keys: npt.NDArray[np.int64] = LAYER_OF_OUTPUT[descriptors["output_id"]]
    return keys


@stateless_processor("demo.head_norms", input="activations", output="head_norms")
def head_norms(records: Records) -> npt.NDArray[np.void]:
    """Mean L2 norm of each head's query (or key) vectors over a sequence's tokens."""
    rows = np.empty(len(records), dtype=HEAD_NORMS.dtype)
    for i in range(len(records)):
        hook = records.hook_name(i)
        per_head = records.tail(i).reshape(-1, HEADS, HIDDEN // HEADS)
        rows[i]["request"] = records.descriptors["key"][i]
        rows[i]["layer"] = int(_LAYER.search(hook).group(1))  # type: ignore[union-attr]
        rows[i]["projection"] = hook.rsplit(".", 1)[-1]
        rows[i]["tokens"] = per_head.shape[0]
        rows[i]["norms"] = np.linalg.norm(per_head, axis=-1).mean(axis=0)
    return rows


@stateful_processor(
    "demo.unit_stats",
    key=layer_key,
    key_range=LAYERS,
    slot=SlotSpec((3, HIDDEN), "float64"),  # count, mean, M2 per hidden unit
    input="activations",
    output="unit_stats",
)
def unit_stats(
    records: Records, keys: npt.NDArray[np.int64], state: StateRegion
) -> npt.NDArray[np.void]:
    """Welford mean and variance of each hidden unit over every token seen, per layer."""
    for i, key in enumerate(keys.tolist()):
        tokens = records.tail(i).reshape(-1, HIDDEN).astype(np.float64)
        count, mean, m2 = state.slots[key]  # views into this layer's slot
        # Merge one sequence's tokens at once (Chan et al.'s parallel update).
        n_b = tokens.shape[0]
        mean_b = tokens.mean(axis=0)
        m2_b = ((tokens - mean_b) ** 2).sum(axis=0)
        total = count + n_b
        delta = mean_b - mean
        mean += delta * n_b / total
        m2 += m2_b + delta**2 * count * n_b / total
        count[:] = total
    layers = np.unique(keys)
    rows = np.empty(len(layers), dtype=UNIT_STATS.dtype)
    rows["layer"] = layers
    rows["count"] = state.slots[layers, 0, 0]
    rows["mean"] = state.slots[layers, 1]
    rows["variance"] = state.slots[layers, 2] / np.maximum(state.slots[layers, 0], 1)
    return rows


def routes(destination: str) -> RoutingConfig:
    """Raw captures forwarded; per-head Q/K norms and per-layer unit stats computed."""
    return RoutingConfig(
        [
            Route("raw", [QK_HOOKS, HIDDEN_HOOKS], destination),
            Route(
                "head_norms",
                QK_HOOKS,
                destination,
                mode="stateless",
                processor="demo.head_norms",
                workers=2,
            ),
            Route(
                "unit_stats",
                HIDDEN_HOOKS,
                destination,
                mode="stateful",
                processor="demo.unit_stats",
                workers=2,
            ),
            Route(
                "qk_spectra",
                SIGNAL_QK_HOOK.format(layer="*"),
                destination,
                mode="stateless",
                processor="signals.qk_spectra",
                workers=2,
            ),
            Route(
                "intrinsic",
                HIDDEN_HOOKS,
                destination,
                mode="stateful",
                processor="demo.intrinsic_dimension",
            ),
        ]
    )
