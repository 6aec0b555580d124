"""Signal processors against known answers and independent references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from taproute.native import make_descriptors
from taproute.routing import InvalidInput, Layout, RecordBatch, Records
from taproute.service.signals import experts, pathways, qk, twonn
from taproute.service.signals.common import all_tokens, tail_layout, window_segments
from tests.signal_records import Stateful, records_of, stateless

QK = tail_layout("qk")
ROUTER = tail_layout("router_logits")
PATH = tail_layout("router_path")
HIDDEN = tail_layout("hidden")

# Test-only configurations, registered once under their own names.
QK_BIDIR = qk.register(
    qk.QKConfig(causal=False, window=3, spectra="test.qk_spectra_bidir", summary="test.qk_summary3")
)
EXPERTS_W4 = experts.register(experts.ExpertConfig(window=4, name="test.experts_w4"))
EXPERTS_TOP1 = experts.register(experts.ExpertConfig(top_k=1, window=2, name="test.experts_top1"))
PATHS_W2 = pathways.register(pathways.PathwayConfig(window=2, name="test.paths_w2"))
PATHS_SKETCH = pathways.register(
    pathways.PathwayConfig(window=1, capacity=4, top=4, name="test.paths_sketch")
)
TWONN_50 = twonn.register(twonn.TwoNNConfig(hidden=50, window=1, name="test.twonn50"))
TWONN_3 = twonn.register(twonn.TwoNNConfig(hidden=3, window=1, name="test.twonn3"))
TWONN_RES = twonn.register(
    twonn.TwoNNConfig(hidden=8, sample=500, window=10, name="test.twonn_reservoir")
)


def qk_record(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    return np.concatenate([q, k], axis=1).astype(np.float32)


# ---- Q/K spectra -------------------------------------------------------------


def test_qk_singular_values_equal_numpy_svd():
    rng = np.random.default_rng(0)
    arrays = [qk_record(rng.normal(size=(t, 384)), rng.normal(size=(t, 384))) for t in (5, 40, 5)]
    rows = stateless("signals.qk_spectra", records_of(arrays, QK, hooks="encoder.layer.3.qk"))
    assert len(rows) == 3 * 12
    assert set(rows["layer"]) == {3} and list(rows["head"][:12]) == list(range(12))
    for i, a in enumerate(arrays):
        q, k = a[:, :384].astype(np.float64), a[:, 384:].astype(np.float64)
        for h in range(12):
            s = slice(32 * h, 32 * (h + 1))
            sv = np.linalg.svd(q[:, s] @ k[:, s].T / math.sqrt(32), compute_uv=False)
            row = rows[i * 12 + h]
            top = np.zeros(8)
            top[: min(8, len(sv))] = sv[:8]
            np.testing.assert_allclose(row["singular_values"], top, rtol=1e-5, atol=1e-6)
            assert row["spectral_norm"] == pytest.approx(sv[0], rel=1e-5)
            assert row["stable_rank"] == pytest.approx((sv**2).sum() / sv[0] ** 2, rel=1e-5)
            p = sv / sv.sum()
            assert row["effective_rank"] == pytest.approx(
                math.exp(-(p * np.log(p)).sum()), rel=1e-5
            )
            assert row["tokens"] == len(a)


@pytest.mark.parametrize("rank", [1, 3, 7])
def test_qk_planted_rank_gives_effective_rank_r(rank):
    rng = np.random.default_rng(rank)
    t, d = 48, 32
    q = np.zeros((t, 384))
    k = np.zeros((t, 384))
    for h in range(12):
        u, _ = np.linalg.qr(rng.normal(size=(t, rank)))
        v, _ = np.linalg.qr(rng.normal(size=(t, rank)))
        o, _ = np.linalg.qr(rng.normal(size=(d, rank)))
        q[:, 32 * h : 32 * (h + 1)] = math.sqrt(d) * u @ o.T  # QKᵀ/√d = U Vᵀ: r values of 1
        k[:, 32 * h : 32 * (h + 1)] = v @ o.T
    q += rng.normal(scale=1e-4, size=q.shape)
    rows = stateless("signals.qk_spectra", records_of([qk_record(q, k)], QK))
    np.testing.assert_allclose(rows["effective_rank"], rank, atol=0.02)
    np.testing.assert_allclose(rows["stable_rank"], rank, atol=0.02)
    np.testing.assert_allclose(rows["spectral_norm"], 1.0, atol=1e-3)


def test_qk_uniform_attention_entropy_is_log_t():
    t = 9
    zeros = np.zeros((t, 384))
    causal = stateless("signals.qk_spectra", records_of([qk_record(zeros, zeros)], QK))
    np.testing.assert_allclose(causal["entropy_last"], math.log(t), rtol=1e-6)
    # Causal row i sees i + 1 keys: entropy log(i + 1); row 0 is left out.
    np.testing.assert_allclose(
        causal["entropy_mean"], np.mean(np.log(np.arange(2, t + 1))), rtol=1e-6
    )
    np.testing.assert_allclose(causal["entropy_min"], math.log(2), rtol=1e-6)
    assert np.all(causal["effective_rank"] == 0)
    both = stateless("test.qk_spectra_bidir", records_of([qk_record(zeros, zeros)], QK))
    for column in ("entropy_mean", "entropy_min", "entropy_last"):
        np.testing.assert_allclose(both[column], math.log(t), rtol=1e-6)


def test_qk_peaked_attention_entropy_is_near_zero():
    t = 6
    q = np.zeros((t, 384))
    k = np.zeros((t, 384))
    q[:, :32] = 400.0  # head 0: every query scores the keys by their first coordinate
    k[:, 0] = np.arange(t)  # the latest visible key wins by a wide margin
    rows = stateless("signals.qk_spectra", records_of([qk_record(q, k)], QK))
    assert rows["entropy_mean"][0] < 1e-3
    assert rows["entropy_mean"][1] == pytest.approx(np.mean(np.log(np.arange(2, t + 1))))


def test_qk_summary_windows_equal_means_of_per_record_rows():
    rng = np.random.default_rng(5)
    arrays = [
        qk_record(rng.normal(size=(t, 384)), rng.normal(size=(t, 384)))
        for t in (4, 6, 4, 9, 4, 5, 7)
    ]
    per_record = stateless("test.qk_spectra_bidir", records_of(arrays, QK))
    summary = Stateful("test.qk_summary3")
    out = []
    for start, stop in ((0, 1), (1, 3), (3, 7)):  # windows of 3 cut across batches
        rows = summary(records_of(arrays[start:stop], QK, hooks="h.2.qk", output_ids=5))
        if rows is not None:
            out.append(rows)
    rows = np.concatenate(out)
    assert list(rows["window"]) == [0] * 12 + [1] * 12  # the 7th record's window is open
    assert set(rows["layer"]) == {2} and set(rows["records"]) == {3}
    for w in (0, 1):
        mine = rows[rows["window"] == w]
        theirs = per_record[36 * w : 36 * (w + 1)].reshape(3, 12)
        np.testing.assert_allclose(
            mine["effective_rank_mean"], theirs["effective_rank"].mean(0), rtol=1e-5
        )
        np.testing.assert_allclose(
            mine["effective_rank_min"], theirs["effective_rank"].min(0), rtol=1e-6
        )
        np.testing.assert_allclose(
            mine["spectral_norm_max"], theirs["spectral_norm"].max(0), rtol=1e-6
        )
        np.testing.assert_allclose(
            mine["stable_rank_mean"], theirs["stable_rank"].mean(0), rtol=1e-5
        )
        np.testing.assert_allclose(mine["entropy_mean"], theirs["entropy_mean"].mean(0), rtol=1e-5)
        np.testing.assert_allclose(mine["entropy_min"], theirs["entropy_min"].min(0), rtol=1e-6)


def test_qk_payload_of_partial_tokens_is_invalid_input():
    with pytest.raises(InvalidInput, match=r"record 0 .* not a whole number of 768-value tokens"):
        stateless("signals.qk_spectra", records_of([np.zeros(770, np.float32)], QK))


# ---- expert health -----------------------------------------------------------


def feed(name: str, batches: list[list[np.ndarray]], layout, **kwargs) -> np.ndarray:
    processor = Stateful(name)
    out = [processor(records_of(b, layout, **kwargs)) for b in batches]
    return np.concatenate([o for o in out if o is not None])


def test_expert_balance_loss_is_one_for_uniform_routers():
    rng = np.random.default_rng(1)
    random_logits = [rng.normal(size=(500, 8)) for _ in range(4)]
    row = feed("test.experts_w4", [random_logits], ROUTER, hooks="model.layers.2.mlp.router")
    assert len(row) == 1 and row["layer"][0] == 2 and row["tokens"][0] == 2000
    assert row["balance_loss"][0] == pytest.approx(1.0, abs=0.05)  # sampling error only
    assert row["load"].sum() == pytest.approx(1.0, rel=1e-6)
    assert row["dead_experts"][0] == 0
    flat = [np.zeros((50, 8)) + np.arange(8) * 0 for _ in range(4)]  # identical logits
    row = feed("test.experts_w4", [flat], ROUTER)
    assert row["balance_loss"][0] == pytest.approx(1.0, abs=1e-6)  # P_i = 1/N exactly
    assert row["router_entropy"][0] == pytest.approx(math.log(8), rel=1e-6)
    assert row["top1_margin"][0] == pytest.approx(0.0, abs=1e-7)


def test_expert_that_takes_every_token_gives_n_and_e_minus_1_dead():
    logits = np.zeros((40, 8))
    logits[:, 3] = 20.0
    row = feed("test.experts_top1", [[logits, logits[:10]]], ROUTER)
    assert row["balance_loss"][0] == pytest.approx(8.0, rel=1e-6)
    assert row["dead_experts"][0] == 7
    np.testing.assert_allclose(row["load"][0], np.eye(8)[3])
    # Capacity per record is floor(1.25 * T / 8): 6 of 40 and 1 of 10 tokens fit.
    assert row["over_capacity"][0] == pytest.approx((34 + 9) / 50, rel=1e-6)
    assert row["top1_margin"][0] == pytest.approx(1.0, abs=1e-6)


def test_expert_counts_equal_independent_softmax_top_k():
    rng = np.random.default_rng(2)
    arrays = [
        rng.normal(scale=2.0, size=(t, 8)).astype(np.float32) for t in (7, 30, 1, 19, 64, 3, 12, 8)
    ]
    rows = feed("test.experts_w4", [arrays[:3], arrays[3:5], arrays[5:]], ROUTER)
    assert len(rows) == 2
    for w in (0, 1):
        logits = torch.from_numpy(np.concatenate(arrays[4 * w : 4 * (w + 1)])).double()
        probs = torch.softmax(logits, dim=-1)
        chosen = torch.topk(logits, 2, dim=-1).indices
        counts = torch.bincount(chosen.reshape(-1), minlength=8).numpy()
        tokens = len(logits)
        row = rows[w]
        np.testing.assert_array_equal(np.rint(row["load"] * tokens * 2), counts)
        np.testing.assert_allclose(row["router_prob"], probs.mean(0).numpy(), rtol=1e-5)
        entropy = -(probs * probs.log()).sum(-1).mean().item()
        assert row["router_entropy"] == pytest.approx(entropy, rel=1e-5)
        top2 = torch.topk(probs, 2, dim=-1).values
        assert row["top1_margin"] == pytest.approx(
            (top2[:, 0] - top2[:, 1]).mean().item(), rel=1e-5
        )
        f, p = counts / (tokens * 2), probs.mean(0).numpy()
        assert row["balance_loss"] == pytest.approx(8 * (f * p).sum(), rel=1e-5)
        overflow = 0
        for a in arrays[4 * w : 4 * (w + 1)]:
            per = torch.bincount(
                torch.topk(torch.from_numpy(a), 2).indices.reshape(-1), minlength=8
            )
            overflow += torch.clamp(per - math.floor(1.25 * len(a) * 2 / 8), min=0).sum().item()
        assert row["over_capacity"] == pytest.approx(overflow / (tokens * 2), rel=1e-6)


# ---- pathways ----------------------------------------------------------------


def planted(paths: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Logits whose per-layer argmax is ``paths`` (noise below the planted 5.0)."""
    logits = rng.random(size=(len(paths), 4, 8))
    np.put_along_axis(logits, paths[:, :, None], 5.0, axis=2)
    return logits.reshape(len(paths), 32)


def test_planted_paths_are_recovered_exactly():
    rng = np.random.default_rng(3)
    patterns = np.array([[0, 1, 2, 3], [7, 7, 7, 7], [1, 0, 1, 0]])
    frequency = np.array([50, 30, 20])
    paths = np.repeat(patterns, frequency, axis=0)
    rng.shuffle(paths)
    first, second = planted(paths[:64], rng), planted(paths[64:], rng)
    row = feed("test.paths_w2", [[first], [second]], PATH, hooks="model.paths")
    assert len(row) == 1 and row["tokens"][0] == 100 and row["exact"][0] == 1
    assert row["distinct_paths"][0] == 3
    np.testing.assert_array_equal(row["top_counts"][0][:3], frequency)
    np.testing.assert_array_equal(row["top_paths"][0][:3], patterns)
    assert np.all(row["top_counts"][0][3:] == 0)
    p = frequency / 100
    assert row["path_entropy"][0] == pytest.approx(-(p * np.log(p)).sum(), rel=1e-6)
    transitions = row["transitions"][0]
    assert transitions.shape == (3, 8, 8)
    np.testing.assert_array_equal(transitions.sum(axis=(1, 2)), [100, 100, 100])
    expected = np.zeros((3, 8, 8), dtype=np.int64)
    for path in paths:
        for layer in range(3):
            expected[layer, path[layer], path[layer + 1]] += 1
    np.testing.assert_array_equal(transitions, expected)


def test_pathway_sketch_keeps_heavy_paths_within_its_bound():
    rng = np.random.default_rng(4)
    heavy = np.array([[1, 2, 3, 4], [5, 5, 5, 5]])
    light = rng.integers(0, 8, size=(40, 4))  # distinct with high probability
    paths = np.concatenate([np.repeat(heavy, [120, 80], axis=0), light])
    rng.shuffle(paths)
    row = feed("test.paths_sketch", [[planted(paths, rng)]], PATH)
    assert row["exact"][0] == 0
    bound = len(paths) / (4 + 1)
    got = dict(zip(map(tuple, row["top_paths"][0]), row["top_counts"][0], strict=True))
    for path, true in ((tuple(heavy[0]), 120), (tuple(heavy[1]), 80)):
        assert true - bound <= got[path] <= true
    np.testing.assert_array_equal(row["transitions"][0].sum(axis=(1, 2)), [len(paths)] * 3)


# ---- TwoNN ---------------------------------------------------------------------


def test_twonn_five_dim_gaussian_in_fifty_dims():
    rng = np.random.default_rng(5)
    points = rng.normal(size=(2000, 5)) @ rng.normal(size=(5, 50))
    row = feed("test.twonn50", [[points]], HIDDEN, hooks="encoder.layer.4.output")
    assert row["sample"][0] == 2000 and row["layer"][0] == 4
    assert row["dimension"][0] == pytest.approx(5.0, abs=0.5)


def test_twonn_swiss_roll_is_two_dimensional():
    rng = np.random.default_rng(6)
    t = 1.5 * np.pi * (1 + 2 * rng.random(2000))
    roll = np.stack([t * np.cos(t), 21 * rng.random(2000), t * np.sin(t)], axis=1)
    row = feed("test.twonn3", [[roll]], tail_layout("hidden"))
    assert row["dimension"][0] == pytest.approx(2.0, abs=0.3)


def test_twonn_reservoir_is_uniform_and_replays_identically():
    rng = np.random.default_rng(7)
    arrays = [np.column_stack([np.full(1000, i), rng.normal(size=(1000, 7))]) for i in range(10)]

    def run() -> tuple[np.ndarray, np.ndarray]:
        processor = Stateful("test.twonn_reservoir")
        rows = [processor(records_of(arrays[i : i + 3], HIDDEN)) for i in range(0, 10, 3)]
        slot = processor.state.slots[0][6:].reshape(500, 8)
        return np.concatenate([r for r in rows if r is not None]), slot.copy()

    rows, _ = run()
    assert rows["tokens"][0] == 10_000 and rows["sample"][0] == 500
    # The reservoir is reset when the window closes; replay the window up to its last batch.
    processor = Stateful("test.twonn_reservoir")
    processor(records_of(arrays[:3], HIDDEN))
    processor(records_of(arrays[3:6], HIDDEN))
    processor(records_of(arrays[6:9], HIDDEN))
    sample = processor.state.slots[0][6:].reshape(500, 8)
    per_record = np.bincount(sample[:, 0].astype(int), minlength=9)
    assert per_record.sum() == 500
    chi2 = ((per_record - 500 / 9) ** 2 / (500 / 9)).sum()
    assert chi2 < 26.1  # chi-square, 8 degrees of freedom, p = 0.001
    again = Stateful("test.twonn_reservoir")
    for i in (0, 3, 6):
        again(records_of(arrays[i : i + 3], HIDDEN))
    np.testing.assert_array_equal(again.state.slots[0], processor.state.slots[0])


def test_twonn_window_smaller_than_sample_uses_every_token():
    rng = np.random.default_rng(8)
    arrays = [rng.normal(size=(t, 8)) for t in (30, 50, 20, 40, 60, 10, 70, 20, 50, 40)]
    row = feed("test.twonn_reservoir", [arrays[:4], arrays[4:]], HIDDEN)
    assert row["sample"][0] == row["tokens"][0] == 390
    assert row["dimension"][0] == pytest.approx(
        twonn.two_nn(np.concatenate(arrays).astype(np.float32)), rel=1e-5
    )


def test_window_segments_cut_at_window_boundaries():
    assert list(window_segments(2, 7, 3)) == [(0, 1, True), (1, 4, True), (4, 7, True)]
    assert list(window_segments(0, 2, 3)) == [(0, 2, False)]


def test_signal_modules_register_only_on_import():
    import subprocess
    import sys

    code = (
        "import taproute.service, taproute.service.signals;"
        "from taproute.routing.processors import REGISTRY;"
        "assert not [n for n in REGISTRY.names() if n.startswith('signals.')], REGISTRY.names();"
        "import taproute.service.signals.qk;"
        "assert 'signals.qk_spectra' in REGISTRY.names()"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_all_tokens_gathers_records_with_holes_between_them_in_record_order():
    """A merged batch spanning a shared pool's buffers (or records padded in
    it) has holes between its records: ``all_tokens`` gathers them natively,
    in record order, as it reads back-to-back records (the fast path)."""
    layout = Layout("toks", [("values", "Array(Float32)")])
    arrays = [
        np.arange(t * 3, dtype=np.float32).reshape(t, 3) + 100 * i
        for i, t in enumerate((2, 0, 5, 1))
    ]
    packed = records_of(arrays, layout)
    # The same records 7 bytes apart (and out of payload order: record 0 last).
    lengths = [a.size * 4 for a in arrays]
    offsets = [sum(lengths[1:]) + 7 * 4, 0, lengths[1] + 7, lengths[1] + lengths[2] + 14]
    payload = np.zeros(offsets[0] + lengths[0] + 5, dtype=np.uint8)
    for array, offset in zip(arrays, offsets, strict=True):
        payload[offset : offset + array.nbytes] = array.reshape(-1).view(np.uint8)
    desc = make_descriptors(0, lengths, offsets=offsets, keys=np.arange(4), count=4)
    scattered = Records(RecordBatch.from_buffer(desc, payload), layout)

    for records in (packed, scattered):
        tokens, counts = all_tokens(records, 3, where="test")
        assert counts.tolist() == [2, 0, 5, 1]
        np.testing.assert_array_equal(tokens, np.concatenate(arrays))
