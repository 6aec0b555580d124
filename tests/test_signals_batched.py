"""The batched signal processors against straightforward per-record references.

Each reference takes one record at a time in plain numpy, the obvious way
(the shape the processors had before they were batched); the processors must
give the same rows on random inputs: ragged batches, records of one token,
empty records, ties, several hooks interleaved, windows cut mid-batch.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict

import numpy as np
import pytest

from taproute import native
from taproute.routing import InvalidInput
from taproute.routing.processors import REGISTRY
from taproute.service.signals import experts, pathways, qk, twonn
from taproute.service.signals.common import tail_layout
from tests.signal_records import Stateful, records_of

ROUTER = tail_layout("router_logits")
PATH = tail_layout("router_path")
QK = tail_layout("qk")
HOOKS = ["model.layers.0.router", "model.layers.5.router", "model.layers.9.router"]

EXPERT_CONFIGS = {
    "default": experts.ExpertConfig(window=5, name="batched.experts"),
    "two experts": experts.ExpertConfig(experts=2, top_k=1, window=3, name="batched.experts_e2"),
    "top_k = experts": experts.ExpertConfig(
        experts=3, top_k=3, window=4, capacity_factor=1.0, name="batched.experts_all"
    ),
    # top_k past 2 and below the expert count: the one-pass insertion, whose
    # full list drops a logit no larger than its last.
    "top 4 of 16": experts.ExpertConfig(experts=16, top_k=4, window=4, name="batched.experts_k4"),
}
for _config in EXPERT_CONFIGS.values():
    experts.register(_config)

PATH_CONFIGS = {
    "default": pathways.PathwayConfig(window=5, name="batched.paths"),
    "two layers": pathways.PathwayConfig(layers=2, experts=3, window=3, name="batched.paths_l2"),
}
for _config in PATH_CONFIGS.values():
    pathways.register(_config)


def ragged_batches(
    rng: np.random.Generator, width: int, *, batches: int = 4, ties: bool = False
) -> list[tuple[list[np.ndarray], list[int]]]:
    """Batches of records ``[tokens, width]`` (0, 1 or up to 40 tokens) and
    their hook ids, hooks interleaved.  ``ties``: small integer values, so
    equal logits are common."""
    out = []
    for _ in range(batches):
        n = int(rng.integers(1, 12))
        tokens = rng.choice([0, 1, 1, 2, 7, 16, 40], size=n)
        arrays = [
            (
                rng.integers(-2, 3, size=(t, width))
                if ties
                else rng.normal(scale=2.0, size=(t, width))
            ).astype(np.float32)
            for t in tokens
        ]
        out.append((arrays, list(rng.integers(0, len(HOOKS), size=n))))
    return out


def run(name: str, layout, batches) -> np.ndarray:
    processor = Stateful(name)
    rows = []
    for arrays, ids in batches:
        out = processor(records_of(arrays, layout, hooks=HOOKS, output_ids=ids))
        if out is not None:
            rows.append(out)
    return np.concatenate(rows) if rows else np.zeros(0)


def per_hook_windows(batches, window: int) -> dict[tuple[str, int], list[np.ndarray]]:
    """(hook, window number) -> that closed window's records, each hook's
    records taken in arrival order and cut into tumbling windows of ``window``."""
    per_hook: dict[int, list[np.ndarray]] = defaultdict(list)
    closed: dict[tuple[str, int], list[np.ndarray]] = {}
    numbers: Counter[int] = Counter()
    for arrays, ids in batches:
        for a, hook in zip(arrays, ids, strict=True):
            per_hook[hook].append(a)
            if len(per_hook[hook]) == window:
                closed[HOOKS[hook], numbers[hook]] = per_hook.pop(hook)
                numbers[hook] += 1
    return closed


def by_window(rows: np.ndarray) -> dict[tuple[str, int], np.void]:
    return {(str(row["hook"]), int(row["window"])): row for row in rows}


# ---- expert health -----------------------------------------------------------


def reference_expert_row(records: list[np.ndarray], config: experts.ExpertConfig) -> dict:
    e, k = config.experts, config.top_k
    counts, prob, tokens = np.zeros(e), np.zeros(e), 0
    entropy = margin = overflow = 0.0
    for logits in records:
        x = logits.astype(np.float64)
        per = np.zeros(e)
        for token in x:
            p = np.exp(token - token.max())
            p /= p.sum()
            prob += p
            entropy += -(p * np.log(p)).sum()
            top2 = np.sort(p)[::-1]
            margin += top2[0] - top2[1]
            for expert in np.argsort(-token, kind="stable")[:k]:
                per[expert] += 1
        capacity = math.floor(config.capacity_factor * len(x) * k / e)
        overflow += np.maximum(per - capacity, 0).sum()
        counts += per
        tokens += len(x)
    load = counts / (max(tokens, 1) * k)
    return {
        "tokens": tokens,
        "load": load,
        "router_prob": prob / max(tokens, 1),
        "router_entropy": entropy / max(tokens, 1),
        "top1_margin": margin / max(tokens, 1),
        "dead_experts": int((counts == 0).sum()),
        "over_capacity": overflow / (max(tokens, 1) * k),
        "balance_loss": e * (load * prob / max(tokens, 1)).sum(),
    }


@pytest.mark.parametrize("ties", [False, True], ids=["random", "ties"])
@pytest.mark.parametrize("which", list(EXPERT_CONFIGS))
def test_expert_health_equals_per_record_reference(which, ties):
    config = EXPERT_CONFIGS[which]
    rng = np.random.default_rng(10)
    batches = ragged_batches(rng, config.experts, batches=8, ties=ties)
    rows = run(config.name, ROUTER, batches)
    expected = per_hook_windows(batches, config.window)
    assert len(expected) >= 3 and len(rows) == len(expected)
    found = by_window(rows)
    assert found.keys() == expected.keys()
    for where, records in expected.items():
        row, ref = found[where], reference_expert_row(records, config)
        assert row["records"] == config.window and row["tokens"] == ref["tokens"]
        assert row["dead_experts"] == ref["dead_experts"]
        for field in ("load", "router_prob", "router_entropy", "top1_margin", "over_capacity",
                      "balance_loss"):  # fmt: skip
            np.testing.assert_allclose(row[field], ref[field], rtol=1e-6, atol=1e-7, err_msg=field)


def test_expert_health_nan_logit_is_nan_statistics_and_routes_last():
    config = EXPERT_CONFIGS["default"]
    logits = np.zeros((1, 8), dtype=np.float32)
    logits[0, 0] = np.nan
    logits[0, 5] = 1.0
    batch = [np.ones((2, 8), np.float32)] * (config.window - 1) + [logits]
    row = run(config.name, ROUTER, [(batch, [0] * config.window)])
    assert math.isnan(row["router_entropy"][0]) and math.isnan(row["top1_margin"][0])
    # The NaN expert sorts after every number: top-2 of the NaN token is 5, then 1.
    counts = np.rint(row["load"][0] * row["tokens"][0] * 2)
    np.testing.assert_array_equal(counts, [8, 9, 0, 0, 0, 1, 0, 0])


# ---- pathways ----------------------------------------------------------------


def reference_path_row(records: list[np.ndarray], config: pathways.PathwayConfig) -> dict:
    layers, e = config.layers, config.experts
    transitions = np.zeros((layers - 1, e, e), dtype=np.int64)
    paths: Counter[tuple[int, ...]] = Counter()
    for logits in records:
        for token in logits.reshape(-1, layers, e):
            path = tuple(int(np.argmax(layer)) for layer in token)
            for layer in range(layers - 1):
                transitions[layer, path[layer], path[layer + 1]] += 1
            paths[path] += 1
    ranked = sorted(paths.items(), key=lambda item: (-item[1], item[0]))[: config.top]
    counts = np.array(list(paths.values()), dtype=np.float64)
    p = counts / max(counts.sum(), 1)
    return {
        "tokens": sum(paths.values()),
        "transitions": transitions,
        "top_paths": [path for path, _ in ranked],
        "top_counts": [count for _, count in ranked],
        "distinct_paths": len(paths),
        "path_entropy": float(-(p * np.log(p)).sum()) if len(p) else 0.0,
    }


@pytest.mark.parametrize("ties", [False, True], ids=["random", "ties"])
@pytest.mark.parametrize("which", list(PATH_CONFIGS))
def test_pathways_equal_per_record_reference(which, ties):
    config = PATH_CONFIGS[which]
    rng = np.random.default_rng(11)
    batches = ragged_batches(rng, config.layers * config.experts, batches=8, ties=ties)
    rows = run(config.name, PATH, batches)
    expected = per_hook_windows(batches, config.window)
    assert len(expected) >= 3 and len(rows) == len(expected)
    found = by_window(rows)
    assert found.keys() == expected.keys()
    for where, records in expected.items():
        row, ref = found[where], reference_path_row(records, config)
        assert row["records"] == config.window and row["tokens"] == ref["tokens"]
        assert row["exact"] == 1 and row["distinct_paths"] == ref["distinct_paths"]
        np.testing.assert_array_equal(row["transitions"], ref["transitions"])
        shown = len(ref["top_counts"])
        np.testing.assert_array_equal(row["top_counts"][:shown], ref["top_counts"])
        assert np.all(row["top_counts"][shown:] == 0)
        np.testing.assert_array_equal(
            row["top_paths"][:shown], np.array(ref["top_paths"]).reshape(shown, config.layers)
        )
        assert row["path_entropy"] == pytest.approx(ref["path_entropy"], rel=1e-6, abs=1e-7)


def test_pathways_nan_logit_is_the_argmax_like_numpy():
    config = PATH_CONFIGS["two layers"]
    logits = np.array([[0.0, 5.0, np.nan, 9.0, 1.0, 2.0]], dtype=np.float32)
    batch = [logits] * config.window
    row = run(config.name, PATH, [(batch, [0] * config.window)])
    np.testing.assert_array_equal(row["top_paths"][0][0], [2, 0])  # first NaN, first max


@pytest.mark.parametrize("capacity", [3, 50, 10_000])
def test_dense_path_counting_equals_sorting(capacity):
    rng = np.random.default_rng(12)
    codes = np.zeros(0, dtype=np.int64)
    counts = np.zeros(0, dtype=np.int64)
    for size in (0, 1, 300, 2000, 40):
        new = rng.zipf(1.5, size=size).astype(np.int64) % 4096
        dense = pathways.merge_counts(codes, counts, new, capacity, space=4096)
        sorted_ = pathways.merge_counts(codes, counts, new, capacity)
        for a, b in zip(dense, sorted_, strict=True):
            np.testing.assert_array_equal(a, b)
        codes, counts, _ = dense


@pytest.mark.parametrize("top", [1, 3, 16, 500])
def test_top_entries_rank_by_count_then_code(top):
    # Many equal counts, so the boundary of the top falls inside a tie.
    rng = np.random.default_rng(top)
    codes = np.sort(rng.choice(4096, size=300, replace=False)).astype(np.int64)
    counts = rng.integers(1, 6, size=300).astype(np.int64)
    expected = sorted(range(300), key=lambda i: (-counts[i], codes[i]))[:top]
    np.testing.assert_array_equal(pathways.top_entries(codes, counts, top), expected)


# ---- TwoNN -------------------------------------------------------------------


def reference_two_nn(points: np.ndarray, discard: float = 0.1) -> float:
    """TwoNN point by point: each point's distances to all others, sorted."""
    x = points.astype(np.float64)
    mus = []
    for i, point in enumerate(x):
        others = np.delete(x, i, axis=0)
        d = np.sort(np.sqrt(((others - point) ** 2).sum(axis=1)))
        if d[0] > 0:
            mus.append(d[1] / d[0])
    mu = np.sort(mus)
    used = int(np.floor(len(mu) * (1 - discard)))
    xs = np.log(mu[:used])
    ys = -np.log(1 - np.arange(1, used + 1) / len(mu))
    return float((xs * ys).sum() / (xs * xs).sum())


@pytest.mark.parametrize("n, dims", [(3, 1), (4, 2), (50, 3), (300, 20)])
def test_two_nn_equals_point_by_point_reference(n, dims):
    rng = np.random.default_rng(13)
    points = rng.normal(size=(n, dims)).astype(np.float32)
    assert twonn.two_nn(points) == pytest.approx(reference_two_nn(points), rel=1e-9)


def test_two_nn_duplicates_are_left_out_and_ties_count_twice():
    # Integer points: every distance is exact, duplicates (r1 = 0) and equal
    # distances are common.
    points = np.random.default_rng(14).integers(-6, 7, size=(200, 3)).astype(np.float32)
    points[5] = points[4]
    assert len(np.unique(points, axis=0)) < len(points)
    expected = reference_two_nn(points)
    assert np.isfinite(expected)
    assert twonn.two_nn(points) == pytest.approx(expected, rel=1e-12)


def test_two_nearest_scans_the_gram_matrix_like_a_sort():
    rng = np.random.default_rng(15)
    x = rng.normal(size=(60, 4))
    x[10] = x[11]
    gram, sq = x @ x.T, (x * x).sum(axis=1)
    d2 = sq[:, None] + sq[None, :] - 2 * gram
    np.fill_diagonal(d2, np.inf)
    expected = np.maximum(np.sort(d2, axis=1)[:, :2], 0.0)
    np.testing.assert_array_equal(native.two_nearest(gram, sq), expected)
    with pytest.raises(ValueError, match="two_nearest"):
        native.two_nearest(gram[:5], sq)
    lone = native.two_nearest(np.ones((2, 2)), np.ones(2))  # one other point only
    assert np.isnan(lone).all()


@pytest.mark.parametrize("case", ["normal", "far from the origin", "lattice", "low rank"])
def test_two_nearest_f32_equals_float64_distances(case):
    """The float32 Gram prefilter finds the same two nearest distances as
    exact float64 differences, including where float32 cancels badly (points
    far from the origin) and where many distances tie (a lattice)."""
    rng = np.random.default_rng(17)
    x = rng.normal(size=(300, 24))
    if case == "far from the origin":
        x = 1000.0 + 0.01 * x
    elif case == "lattice":
        x = rng.integers(-2, 3, size=(300, 24)).astype(np.float64)
        x[9] = x[8]
    elif case == "low rank":
        x = rng.normal(size=(300, 2)) @ rng.normal(size=(2, 24))
    x32 = x.astype(np.float32)
    dims = x32.shape[1]
    slack = 1.01 * dims * 2.0**-24 / (1 - dims * 2.0**-24)
    found = native.two_nearest_f32(x32, x32 @ x32.T, slack)
    x64 = x32.astype(np.float64)
    exact = ((x64[:, None, :] - x64[None, :, :]) ** 2).sum(-1)
    np.fill_diagonal(exact, np.inf)
    np.testing.assert_allclose(found, np.sort(exact, axis=1)[:, :2], rtol=1e-12, atol=0)


# ---- Q/K spectra -------------------------------------------------------------

QK_CONFIGS = {
    "causal": qk.QKConfig(
        hidden=16, heads=4, top_k=6, window=4, spectra="batched.qk", summary="batched.qk_sum"
    ),
    "bidirectional": qk.QKConfig(
        hidden=16,
        heads=4,
        top_k=3,
        causal=False,
        window=4,
        spectra="batched.qk_bidir",
        summary="batched.qk_bidir_sum",
    ),
}
for _config in QK_CONFIGS.values():
    qk.register(_config)


def reference_qk_rows(a: np.ndarray, config: qk.QKConfig) -> list[dict]:
    """One record, head by head: numpy's SVD and a masked softmax per query row."""
    t, d = len(a), config.hidden // config.heads
    out = []
    for h in range(config.heads):
        q = a[:, h * d : (h + 1) * d].astype(np.float64)
        k = a[:, config.hidden + h * d : config.hidden + (h + 1) * d].astype(np.float64)
        scores = q @ k.T / math.sqrt(d)
        sv = np.linalg.svd(scores, compute_uv=False)
        p = sv / sv.sum() if sv.sum() > 0 else sv
        entropies = []
        for i in range(t):
            row = scores[i, : i + 1] if config.causal else scores[i]
            w = np.exp(row - row.max())
            w /= w.sum()
            entropies.append(-(w[w > 0] * np.log(w[w > 0])).sum())
        counted = entropies[1:] if config.causal and t > 1 else entropies
        out.append({
            "singular_values": np.pad(sv, (0, max(0, config.top_k - len(sv))))[: config.top_k],
            "spectral_norm": sv[0],
            "stable_rank": (sv**2).sum() / sv[0] ** 2 if sv[0] > 0 else 0.0,
            "effective_rank": np.exp(-(p[p > 0] * np.log(p[p > 0])).sum()) if sv[0] > 0 else 0.0,
            "entropy_mean": np.mean(counted),
            "entropy_min": np.min(counted),
            "entropy_last": entropies[-1],
        })  # fmt: skip
    return out


def qk_batch(rng: np.random.Generator, config: qk.QKConfig) -> list[np.ndarray]:
    """Ragged records around d = 4: 1, 2, 3, 4, 5, 9 and 17 tokens, one of
    rank 1 (every token the same), one with all-zero keys."""
    arrays = [
        rng.normal(size=(t, 2 * config.hidden)).astype(np.float32)
        for t in (1, 2, 3, 4, 5, 9, 17, 9, 4, 1)
    ]
    arrays[7][:] = arrays[7][0]
    arrays[8][:, config.hidden :] = 0.0
    return arrays


def long_keys_batch(rng: np.random.Generator, config: qk.QKConfig) -> list[np.ndarray]:
    """Records longer than d whose keys span fewer than d dimensions in some
    head: exactly (12 tokens: a zero key coordinate, Kᵀ K singular) or up to
    1e-4 (13 tokens: Kᵀ K ill-conditioned), each beside a full-rank record of
    the same length."""
    d, hidden = config.hidden // config.heads, config.hidden
    arrays = [rng.normal(size=(t, 2 * hidden)).astype(np.float32) for t in (12, 12, 13, 13)]
    arrays[1][:, hidden + d - 1] = 0.0  # head 0's last key coordinate
    basis = rng.normal(size=(2, d))
    for h in (0, 2):
        keys = rng.normal(size=(13, 2)) @ basis + 1e-4 * rng.normal(size=(13, d))
        arrays[3][:, hidden + h * d : hidden + (h + 1) * d] = keys
    return arrays


@pytest.mark.parametrize("which", list(QK_CONFIGS))
@pytest.mark.parametrize("batch", [qk_batch, long_keys_batch])
def test_qk_spectra_equal_per_record_reference(which, batch):
    config = QK_CONFIGS[which]
    arrays = batch(np.random.default_rng(16), config)
    rows = REGISTRY.get(config.spectra).fn(records_of(arrays, QK, hooks=HOOKS))
    assert len(rows) == len(arrays) * config.heads
    for r, a in enumerate(arrays):
        for h, ref in enumerate(reference_qk_rows(a, config)):
            row = rows[r * config.heads + h]
            assert row["head"] == h and row["tokens"] == len(a)
            scale = max(ref["spectral_norm"], 1e-30)
            np.testing.assert_allclose(
                row["singular_values"], ref["singular_values"], rtol=1e-5, atol=1e-6 * scale
            )
            for field in ("spectral_norm", "entropy_mean", "entropy_min", "entropy_last"):
                assert row[field] == pytest.approx(ref[field], rel=1e-5, abs=1e-6), field
            if ref["spectral_norm"] > 0:
                for field in ("stable_rank", "effective_rank"):
                    assert row[field] == pytest.approx(ref[field], rel=1e-4, abs=1e-5), field


@pytest.mark.parametrize("which", list(QK_CONFIGS))
@pytest.mark.parametrize("tokens", [3, 20], ids=["T<d", "T>d"])
@pytest.mark.parametrize(("side", "value"), [("q", np.nan), ("k", np.inf), ("k", -np.inf)])
def test_qk_spectra_refuse_non_finite_values_naming_the_record(which, tokens, side, value):
    """A NaN or infinity has no spectrum: LAPACK refused it (a ValueError, taken
    for a bug in the processor) without saying where.  Now it is bad input
    (``handler_invalid``) naming the record, so the route re-runs the batch
    record by record and gives up that record only."""
    config = QK_CONFIGS[which]
    rng = np.random.default_rng(5)
    arrays = [rng.normal(size=(tokens, 2 * config.hidden)).astype(np.float32) for _ in range(3)]
    arrays[1][tokens // 2, 0 if side == "q" else config.hidden + 1] = value
    fn = REGISTRY.get(config.spectra).fn
    with pytest.raises(InvalidInput, match=r"NaN or infinity .* of record 1 \(hook .*key 1, step"):
        fn(records_of(arrays, QK, hooks=HOOKS))
    assert len(fn(records_of(arrays[::2], QK, hooks=HOOKS))) == 2 * config.heads
