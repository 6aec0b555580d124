"""Intrinsic dimension of hidden states: the TwoNN estimator (Facco et al., 2017).

Input (layout ``hidden``, one ``Array(Float32)`` column): one record per
sequence and layer, its token vectors ``[tokens, hidden]`` (the demo captures
``encoder.layer.N.output``).

``signals.intrinsic_dimension`` keeps one slot per hook (= per layer): a
reservoir sample of at most ``sample`` token vectors, uniform over every
token of the current window (Vitter's Algorithm R, vectorised per batch; the
random draws are seeded from ``(seed, hook, window, tokens seen)``, so a
replay of the same records draws the same sample).  When a tumbling window of
``window`` records closes it writes one row with the TwoNN estimate over the
sample and starts the next window empty.

TwoNN: for each point, mu = r2 / r1 (second to first nearest-neighbour
distance; points with a duplicate, r1 = 0, are left out); sort mu, drop the
largest ``discard`` fraction (default 10%, as Facco et al. do, since the
tail is where the model's assumptions fail), and fit -log(1 - F(mu)) = d log(mu)
through the origin by least squares, F(mu_i) = i / N the empirical CDF.
"""

from __future__ import annotations

import attrs
import numpy as np
import numpy.typing as npt

from taproute.native import StateRegion, two_nearest, two_nearest_f32
from taproute.routing import ConfigError, Layout, Records, SlotSpec, stateful_processor
from taproute.routing.processors import REGISTRY, ProcessorRegistry
from taproute.service.signals.common import (
    DEFAULT_KEY_RANGE,
    Registered,
    all_tokens,
    hook_key,
    hooks_and_layers,
    keys_in_order,
    positive,
    tail_layout,
    window_segments,
)

# A slot is float32: three int64 header fields in its first six cells, then the reservoir.
_HEADER = 6

#: Fewer sampled points than this give no estimate (NaN).
MIN_POINTS = 3


@attrs.frozen(kw_only=True)
class TwoNNConfig:
    """Shape and naming of one intrinsic-dimension processor."""

    hidden: int = attrs.field(default=384, validator=positive)
    sample: int = attrs.field(default=2000, validator=positive)  # reservoir size per hook
    window: int = attrs.field(default=64, validator=positive)  # records per hook
    discard: float = 0.1
    seed: int = 0
    key_range: int = attrs.field(default=DEFAULT_KEY_RANGE, validator=positive)
    input: str = "hidden"
    name: str = "signals.intrinsic_dimension"
    output: str = "intrinsic_dimension"

    def __attrs_post_init__(self) -> None:
        if not 0.0 <= self.discard < 1.0:
            raise ConfigError(f"TwoNNConfig: discard must be in [0, 1), got {self.discard}")


def two_nn(points: npt.NDArray[np.generic], discard: float = 0.1) -> float:
    """The TwoNN intrinsic dimension of ``points`` (``[n, dims]``); NaN if too few.

    The nearest-neighbour distances come off a Gram matrix (BLAS) in one
    native pass, never an n x n distance array.  float32 points (a reservoir
    is float32) take a float32 Gram matrix, half the time of float64, and
    :func:`taproute.native.two_nearest_f32` recomputes in float64 every
    neighbour its rounding bound cannot rule out: the same neighbours and
    distances as float64 arithmetic.  Other dtypes: a float64 Gram matrix
    (:func:`taproute.native.two_nearest`).
    """
    if len(points) < MIN_POINTS:
        return float("nan")
    if points.dtype == np.float32:
        x32 = np.ascontiguousarray(points)
        dims = x32.shape[1]
        unit = 2.0**-24
        slack = 1.01 * dims * unit / (1.0 - dims * unit) + 1e-15
        nearest = np.sqrt(two_nearest_f32(x32, x32 @ x32.T, slack))
    else:
        x = np.asarray(points, dtype=np.float64)
        sq = (x * x).sum(axis=1)
        nearest = np.sqrt(two_nearest(x @ x.T, sq))
    r1, r2 = nearest[:, 0], nearest[:, 1]
    keep = r1 > 0
    mu = np.sort(r2[keep] / r1[keep])
    n = len(mu)
    if n < MIN_POINTS:
        return float("nan")
    used = int(np.floor(n * (1.0 - discard)))
    f = np.arange(1, used + 1) / n
    xs = np.log(mu[:used])
    ys = -np.log(1.0 - f)
    denominator = float((xs * xs).sum())
    return float((xs * ys).sum() / denominator) if denominator > 0 else float("nan")


def reservoir_update(
    reservoir: npt.NDArray[np.generic],
    seen: int,
    points: npt.NDArray[np.generic],
    rng: np.random.Generator,
) -> int:
    """Feed ``points`` (in order) to the reservoir that has seen ``seen`` points so far.

    Algorithm R: point number g (0-based) is kept with probability
    size / (g + 1), replacing a uniformly chosen slot.  Returns the new ``seen``.
    """
    size = len(reservoir)
    m = len(points)
    fill = max(0, min(size - seen, m))
    if fill:
        reservoir[seen : seen + fill] = points[:fill]
    if m > fill:
        g = seen + np.arange(fill, m)
        slots = rng.integers(0, g + 1)
        accept = np.flatnonzero(slots < size)
        if len(accept):
            # Later points overwrite earlier ones at the same slot: keep the last.
            last_first = accept[::-1]
            _, first = np.unique(slots[last_first], return_index=True)
            chosen = last_first[first]
            reservoir[slots[chosen]] = points[fill + chosen]
    return seen + m


def dimension_layout(config: TwoNNConfig) -> Layout:
    """Rows of ``signals.intrinsic_dimension``: one per hook and closed window."""
    return Layout(
        config.output,
        [
            ("hook", "LowCardinality(String)"),
            ("layer", "Int16"),
            ("window", "UInt32"),
            ("records", "UInt32"),
            ("tokens", "UInt64"),
            ("sample", "UInt32"),
            ("dimension", "Float32"),
        ],
    )


def register(config: TwoNNConfig, *, registry: ProcessorRegistry = REGISTRY) -> Registered:
    """Register ``config.name``: a stateful processor with one reservoir per hook."""
    layout = dimension_layout(config)
    where = f"processor {config.name!r}"

    def intrinsic_dimension(
        records: Records, keys: npt.NDArray[np.int64], state: StateRegion
    ) -> npt.NDArray[np.void] | None:
        vectors, tokens = all_tokens(records, config.hidden, where=where)
        record_of_token = np.repeat(np.arange(len(records)), tokens)
        out: list[npt.NDArray[np.void]] = []
        for key, index in keys_in_order(keys):
            slot = state.slots[key]
            header = slot[:_HEADER].view(np.int64)  # [records, window, tokens seen]
            reservoir = slot[_HEADER:].reshape(config.sample, config.hidden)
            hook, layer = hooks_and_layers(records, index[:1])
            for start, stop, closes in window_segments(int(header[0]), len(index), config.window):
                part = index[start:stop]
                points = vectors[np.isin(record_of_token, part)]
                window, seen = int(header[1]), int(header[2])
                rng = np.random.default_rng([config.seed, key, window, seen])
                header[2] = reservoir_update(reservoir, seen, points, rng)
                header[0] += len(part)
                if closes:
                    held = min(int(header[2]), config.sample)
                    row = np.zeros(1, dtype=layout.dtype)
                    row["hook"] = hook[0]
                    row["layer"] = layer[0]
                    row["window"] = window
                    row["records"] = header[0]
                    row["tokens"] = header[2]
                    row["sample"] = held
                    row["dimension"] = two_nn(reservoir[:held], config.discard)
                    out.append(row)
                    header[:3] = (0, window + 1, 0)
        return np.concatenate(out) if out else None

    stateful_processor(
        config.name,
        key=hook_key,
        key_range=config.key_range,
        slot=SlotSpec((_HEADER + config.sample * config.hidden,), "float32"),
        input=config.input,
        output=layout.name,
        registry=registry,
    )(intrinsic_dimension)
    return Registered((config.name,), tail_layout(config.input), (layout,))


#: The default configuration (384-wide hidden states, 2,000-point reservoir), registered on import.
DEFAULT = TwoNNConfig()
SIGNALS = register(DEFAULT)
