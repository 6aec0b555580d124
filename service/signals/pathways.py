"""Pathways: which experts a token visits, layer after layer.

Input (layout ``router_path``, one ``Array(Float32)`` column): one record per
sequence holding every MoE layer's router logits for its tokens,
``[tokens, layers * experts]`` (layer-major;
:func:`taproute.service.signals.taps.bind_router_path` captures that).  A
token's path is its top-1 expert (ties: lower index) at each layer.

``signals.pathways`` keeps one slot per hook and, when a tumbling window of
``window`` records closes, writes one row:

- ``transitions``: per consecutive layer pair an experts x experts count
  matrix (``[layers - 1, experts, experts]``, from-expert rows); each pair
  sums to the window's token count;
- ``top_paths`` / ``top_counts``: the ``top`` most frequent paths (count 0
  marks padding) and ``distinct_paths``, ``path_entropy`` (nats) over paths.

Path counts are exact while a window has at most ``capacity`` distinct paths
(``exact`` = 1).  Past that they come from a Misra-Gries summary with
``capacity`` counters, merged batch by batch ("mergeable summaries", Agarwal
et al., 2012): every count is then underestimated by at most
tokens / (capacity + 1), every path more frequent than that is kept,
``distinct_paths`` counts the paths still held and ``path_entropy`` is
computed from the held counts (``exact`` = 0).
"""

from __future__ import annotations

import attrs
import numpy as np
import numpy.typing as npt

from taproute.native import StateRegion
from taproute.native import path_codes as native_path_codes
from taproute.routing import ConfigError, Layout, Records, SlotSpec, stateful_processor
from taproute.routing.processors import REGISTRY, ProcessorRegistry
from taproute.service.signals.common import (
    DEFAULT_KEY_RANGE,
    Registered,
    all_tokens,
    float_rows,
    hook_key,
    positive,
    tail_layout,
    token_ranges,
    tumbling_windows,
)


@attrs.frozen(kw_only=True)
class PathwayConfig:
    """Shape and naming of one pathway processor."""

    layers: int = attrs.field(default=4, validator=positive)
    experts: int = attrs.field(default=8, validator=positive)
    window: int = attrs.field(default=64, validator=positive)  # records per hook
    capacity: int = attrs.field(default=4096, validator=positive)  # exact distinct paths
    top: int = attrs.field(default=16, validator=positive)  # paths written per window
    key_range: int = attrs.field(default=DEFAULT_KEY_RANGE, validator=positive)
    input: str = "router_path"
    name: str = "signals.pathways"
    output: str = "pathways"

    def __attrs_post_init__(self) -> None:
        if self.layers < 2 or self.experts < 2:
            raise ConfigError("PathwayConfig: need at least 2 layers and 2 experts")
        if self.layers * np.log2(self.experts) >= 63:
            raise ConfigError(
                f"PathwayConfig: experts**layers = {self.experts}**{self.layers} paths do not "
                "fit the int64 path code"
            )
        if self.top > self.capacity:
            raise ConfigError("PathwayConfig: top must be <= capacity")


def decode_paths(codes: npt.NDArray[np.int64], layers: int, experts: int) -> npt.NDArray[np.int64]:
    """Paths ``[n, layers]`` from their codes (base-``experts`` digits, first
    layer first, as :func:`taproute.native.path_codes` writes them)."""
    powers = experts ** np.arange(layers - 1, -1, -1, dtype=np.int64)
    decoded: npt.NDArray[np.int64] = (codes[:, None] // powers) % experts
    return decoded


#: Path spaces (experts ** layers) up to this size are counted densely.
DENSE_PATHS = 1 << 16


def merge_counts(
    codes: npt.NDArray[np.int64],
    counts: npt.NDArray[np.int64],
    new_codes: npt.NDArray[np.int64],
    capacity: int,
    *,
    space: int | None = None,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], bool]:
    """Merge ``new_codes`` (one per token) into the summary ``(codes, counts)``.

    Returns the new summary (at most ``capacity`` entries, in code order) and
    whether it had to drop counts (the Misra-Gries reduction: past
    ``capacity`` distinct codes, every count drops by the ``capacity + 1``-th
    largest and those left at zero go).  ``space``: codes lie in
    ``[0, space)``; when that is at most :data:`DENSE_PATHS` they are counted
    in a dense array (one ``bincount``) rather than sorted.  Nothing is
    ranked here: a batch merges in linear time, and :func:`top_entries`
    ranks once per window.
    """
    if space is not None and space <= DENSE_PATHS:
        dense = np.bincount(new_codes, minlength=space)
        dense[codes] += counts  # held codes are distinct
        unique = np.flatnonzero(dense)
        summed = dense[unique]
    else:
        unique, inverse = np.unique(np.concatenate([codes, new_codes]), return_inverse=True)
        weights = np.concatenate([counts, np.ones(len(new_codes), dtype=np.int64)])
        summed = np.bincount(inverse, weights=weights, minlength=len(unique)).astype(np.int64)
    if len(unique) <= capacity:
        return unique, summed, False
    # The (capacity + 1)-th largest count, without sorting them all.
    cut = np.partition(summed, len(summed) - capacity - 1)[len(summed) - capacity - 1]
    keep = summed > cut
    return unique[keep], summed[keep] - cut, True


def top_entries(
    codes: npt.NDArray[np.int64], counts: npt.NDArray[np.int64], top: int
) -> npt.NDArray[np.intp]:
    """Indexes of the ``top`` largest ``counts`` (equal counts: lower code
    first), largest first: the ranking of a window's row."""
    if len(counts) > top:
        # Ties at the boundary: lexsort after the partition decides, so the
        # set is taken by the bound below, not by argpartition's luck.
        bound = np.partition(counts, len(counts) - top)[len(counts) - top]
        candidates = np.flatnonzero(counts >= bound)
    else:
        candidates = np.arange(len(counts))
    order = np.lexsort((codes[candidates], -counts[candidates]))
    return candidates[order[:top]]


def pathway_layout(config: PathwayConfig) -> Layout:
    """Rows of ``signals.pathways``: one per hook and closed window."""
    layers, experts = config.layers, config.experts
    return Layout(
        config.output,
        [
            ("hook", "LowCardinality(String)"),
            ("window", "UInt32"),
            ("records", "UInt32"),
            ("tokens", "UInt64"),
            ("transitions", "Array(UInt64)", (layers - 1, experts, experts)),
            ("top_paths", "Array(UInt16)", (config.top, layers)),
            ("top_counts", "Array(UInt64)", (config.top,)),
            ("distinct_paths", "UInt64"),
            ("path_entropy", "Float32"),
            ("exact", "UInt8"),
        ],
    )


# Slot (int64): [records, window, tokens, held paths, approximate, -, -, -,
# transitions[(L-1) E E], codes[capacity], counts[capacity]].
_HEAD = 8


def register(config: PathwayConfig, *, registry: ProcessorRegistry = REGISTRY) -> Registered:
    """Register ``config.name``: a stateful processor with one slot per hook."""
    layout = pathway_layout(config)
    layers, experts, cap = config.layers, config.experts, config.capacity
    cells = (layers - 1) * experts * experts
    codes_at = _HEAD + cells
    counts_at = codes_at + cap
    where = f"processor {config.name!r}"

    def pathways(
        records: Records, keys: npt.NDArray[np.int64], state: StateRegion
    ) -> npt.NDArray[np.void] | None:
        logits, tokens = all_tokens(records, layers * experts, where=where)
        codes, transitions = native_path_codes(float_rows(logits), tokens, layers, experts)
        first_token = np.cumsum(tokens) - tokens

        def add(slot: npt.NDArray[np.int64], part: npt.NDArray[np.intp]) -> None:
            token_index = token_ranges(first_token[part], tokens[part])
            held = int(slot[3])
            merged, counts, dropped = merge_counts(
                slot[codes_at : codes_at + held],
                slot[counts_at : counts_at + held],
                codes[token_index],
                cap,
                space=experts**layers,
            )
            slot[2] += len(token_index)
            slot[3] = len(merged)
            slot[4] |= int(dropped)
            slot[_HEAD:codes_at] += transitions[part].sum(axis=0).reshape(-1)
            slot[codes_at : codes_at + len(merged)] = merged
            slot[counts_at : counts_at + len(merged)] = counts

        def row(slot: npt.NDArray[np.int64], first: int) -> npt.NDArray[np.void]:
            hook = records.hook_name(first)
            return _window_row(layout, slot, hook, config, codes_at, counts_at)

        return tumbling_windows(keys, state.slots, config.window, add, row)

    stateful_processor(
        config.name,
        key=hook_key,
        key_range=config.key_range,
        slot=SlotSpec((counts_at + cap,), "int64"),
        input=config.input,
        output=layout.name,
        registry=registry,
    )(pathways)
    return Registered((config.name,), tail_layout(config.input), (layout,))


def path_entropy(counts: npt.NDArray[np.integer]) -> float:
    """Entropy (nats) of the distribution ``counts`` describe."""
    total = counts.sum()
    if total <= 0:
        return 0.0
    p = counts[counts > 0] / total
    return float(-(p * np.log(p)).sum())


def _window_row(
    layout: Layout,
    slot: npt.NDArray[np.int64],
    hook: str,
    config: PathwayConfig,
    codes_at: int,
    counts_at: int,
) -> npt.NDArray[np.void]:
    held = int(slot[3])
    codes, counts = slot[codes_at : codes_at + held], slot[counts_at : counts_at + held]
    ranked = top_entries(codes, counts, config.top)
    shown = len(ranked)
    row = np.zeros(1, dtype=layout.dtype)
    row["hook"] = hook
    row["window"] = slot[1]
    row["records"] = slot[0]
    row["tokens"] = slot[2]
    row["transitions"] = slot[_HEAD:codes_at].reshape(layout.dtype["transitions"].shape)
    row["top_paths"][0, :shown] = decode_paths(codes[ranked], config.layers, config.experts)
    row["top_counts"][0, :shown] = counts[ranked]
    row["distinct_paths"] = held
    row["path_entropy"] = path_entropy(counts)
    row["exact"] = 0 if slot[4] else 1
    return row


#: The default configuration (4 layers of 8 experts), registered on import.
DEFAULT = PathwayConfig()
SIGNALS = register(DEFAULT)
