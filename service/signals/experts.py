"""Expert health: how an MoE layer's router spreads tokens over its experts.

Input (layout ``router_logits``, one ``Array(Float32)`` column): one record
per sequence and MoE layer, the router's logits ``[tokens, experts]``
(:func:`taproute.service.signals.taps.bind_router` captures them).  Routing is
top-``top_k`` of the logits (ties: the lower expert index wins).

``signals.expert_health`` keeps one slot per hook (= per layer) and, when a
tumbling window of ``window`` records closes, writes one row:

- ``load``: f_i, the fraction of the window's token-to-expert assignments
  (tokens x top_k) that went to expert i (sums to 1);
- ``router_prob``: P_i, the mean softmax probability of expert i over tokens;
- ``balance_loss``: the Switch Transformer auxiliary loss N * Σ f_i P_i
  (1.0 when balanced, N when one expert takes every token with top_k = 1);
- ``router_entropy``: mean over tokens of the router softmax's entropy (nats);
- ``top1_margin``: mean over tokens of p(first) - p(second);
- ``dead_experts``: experts no token was assigned to in the window;
- ``over_capacity``: the fraction of assignments past capacity, with capacity
  floor(capacity_factor * tokens * top_k / experts) per expert *per record*
  (one record = one sequence's forward pass).
"""

from __future__ import annotations

import attrs
import numpy as np
import numpy.typing as npt

from taproute.native import StateRegion
from taproute.native import router_stats as native_router_stats
from taproute.routing import ConfigError, Layout, Records, SlotSpec, stateful_processor
from taproute.routing.processors import REGISTRY, ProcessorRegistry
from taproute.service.signals.common import (
    DEFAULT_KEY_RANGE,
    Registered,
    all_tokens,
    float_rows,
    hook_key,
    hooks_and_layers,
    positive,
    tail_layout,
    tumbling_windows,
)


@attrs.frozen(kw_only=True)
class ExpertConfig:
    """Shape and naming of one expert-health processor."""

    experts: int = attrs.field(default=8, validator=positive)
    top_k: int = attrs.field(default=2, validator=positive)
    capacity_factor: float = 1.25
    window: int = attrs.field(default=64, validator=positive)  # records per hook
    key_range: int = attrs.field(default=DEFAULT_KEY_RANGE, validator=positive)
    input: str = "router_logits"
    name: str = "signals.expert_health"
    output: str = "expert_health"

    def __attrs_post_init__(self) -> None:
        if not 1 <= self.top_k <= self.experts or self.experts < 2:
            raise ConfigError(
                f"ExpertConfig: need 2 <= experts and 1 <= top_k <= experts, "
                f"got experts={self.experts}, top_k={self.top_k}"
            )


@attrs.frozen
class RouterStats:
    """Per record: sums the window rows are built from (``[n]`` or ``[n, experts]``)."""

    tokens: npt.NDArray[np.int64]
    counts: npt.NDArray[np.float64]  # assignments per expert
    prob_sum: npt.NDArray[np.float64]  # Σ softmax probability per expert
    entropy_sum: npt.NDArray[np.float64]
    margin_sum: npt.NDArray[np.float64]
    overflow: npt.NDArray[np.float64]  # assignments past capacity


def router_stats(
    logits: npt.NDArray[np.generic],
    tokens: npt.NDArray[np.int64],
    *,
    top_k: int,
    capacity_factor: float,
) -> RouterStats:
    """Statistics of ``len(tokens)`` records whose logits are ``logits``, record
    after record: one native pass over the batch's tokens
    (:func:`taproute.native.router_stats`), no per-record Python."""
    counts, prob_sum, entropy_sum, margin_sum, overflow = native_router_stats(
        float_rows(logits),
        np.ascontiguousarray(tokens, dtype=np.int64),
        top_k,
        capacity_factor,
    )
    return RouterStats(
        tokens=tokens,
        counts=counts.astype(np.float64),
        prob_sum=prob_sum,
        entropy_sum=entropy_sum,
        margin_sum=margin_sum,
        overflow=overflow.astype(np.float64),
    )


def health_layout(config: ExpertConfig) -> Layout:
    """Rows of ``signals.expert_health``: one per hook and closed window."""
    e = config.experts
    return Layout(
        config.output,
        [
            ("hook", "LowCardinality(String)"),
            ("layer", "Int16"),
            ("window", "UInt32"),
            ("records", "UInt32"),
            ("tokens", "UInt64"),
            ("load", "Array(Float32)", (e,)),
            ("router_prob", "Array(Float32)", (e,)),
            ("balance_loss", "Float32"),
            ("router_entropy", "Float32"),
            ("top1_margin", "Float32"),
            ("dead_experts", "UInt16"),
            ("over_capacity", "Float32"),
        ],
    )


# Slot (float64): [records, window, tokens, Σ entropy, Σ margin, overflow, -, -,
# counts[E], Σ prob[E]].
_HEAD = 8


def register(config: ExpertConfig, *, registry: ProcessorRegistry = REGISTRY) -> Registered:
    """Register ``config.name``: a stateful processor with one slot per hook."""
    layout = health_layout(config)
    e, k = config.experts, config.top_k
    where = f"processor {config.name!r}"

    def expert_health(
        records: Records, keys: npt.NDArray[np.int64], state: StateRegion
    ) -> npt.NDArray[np.void] | None:
        logits, tokens = all_tokens(records, e, where=where)
        stats = router_stats(logits, tokens, top_k=k, capacity_factor=config.capacity_factor)

        def add(slot: npt.NDArray[np.float64], part: npt.NDArray[np.intp]) -> None:
            slot[2] += stats.tokens[part].sum()
            slot[3] += stats.entropy_sum[part].sum()
            slot[4] += stats.margin_sum[part].sum()
            slot[5] += stats.overflow[part].sum()
            slot[_HEAD : _HEAD + e] += stats.counts[part].sum(axis=0)
            slot[_HEAD + e :] += stats.prob_sum[part].sum(axis=0)

        def row(slot: npt.NDArray[np.float64], first: int) -> npt.NDArray[np.void]:
            hook, layer = hooks_and_layers(records, np.array([first]))
            return _window_row(layout, slot, hook[0], int(layer[0]), e, k)

        return tumbling_windows(keys, state.slots, config.window, add, row)

    stateful_processor(
        config.name,
        key=hook_key,
        key_range=config.key_range,
        slot=SlotSpec((_HEAD + 2 * e,), "float64"),
        input=config.input,
        output=layout.name,
        registry=registry,
    )(expert_health)
    return Registered((config.name,), tail_layout(config.input), (layout,))


def _window_row(
    layout: Layout, slot: npt.NDArray[np.float64], hook: str, layer: int, e: int, k: int
) -> npt.NDArray[np.void]:
    row = np.zeros(1, dtype=layout.dtype)
    tokens = max(slot[2], 1.0)
    counts = slot[_HEAD : _HEAD + e]
    load = counts / (tokens * k)
    prob = slot[_HEAD + e :] / tokens
    row["hook"] = hook
    row["layer"] = layer
    row["window"] = slot[1]
    row["records"] = slot[0]
    row["tokens"] = slot[2]
    row["load"] = load
    row["router_prob"] = prob
    row["balance_loss"] = e * float((load * prob).sum())
    row["router_entropy"] = slot[3] / tokens
    row["top1_margin"] = slot[4] / tokens
    row["dead_experts"] = int((counts == 0).sum())
    row["over_capacity"] = slot[5] / (tokens * k)
    return row


#: The default configuration (8 experts, top-2), registered on import.
DEFAULT = ExpertConfig()
SIGNALS = register(DEFAULT)
