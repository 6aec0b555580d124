"""`taproute demo`: the README's main job, end to end, as CI's smoke test."""

from __future__ import annotations

import numpy as np
import torch

from taproute.service.demo import minilm, processors, run
from taproute.service.host.cli import main

SENTENCES = 24


def test_demo_captures_minilm_and_lands_every_route_in_chdb(capsys, chdb_transport):
    # chDB allows one data directory per process: the demo shares the test session's.
    assert main(["demo", "--sentences", str(SENTENCES), "--data", str(chdb_transport.path)]) == 0
    out = capsys.readouterr().out
    text = out.splitlines()
    header = next(i for i, line in enumerate(text) if line.startswith("route"))
    routes = {line.split()[0]: line.split() for line in text[header + 1 : header + 4]}
    hooks_per_sentence = processors.LAYERS * 3  # query, key and hidden state of each layer
    assert routes["raw"][1:] == ["forward", *[str(SENTENCES * hooks_per_sentence)] * 2, "0"]
    assert routes["head_norms"][1:] == ["stateless", *[str(SENTENCES * 12)] * 2, "0"]
    assert routes["unit_stats"][1:3] == ["stateful", str(SENTENCES * 6)]
    assert "layer 5  query" in out

    query = chdb_transport.query
    counts = query(
        "SELECT (SELECT count() FROM raw_activations) AS raw, "
        "(SELECT count() FROM head_norms) AS norms, "
        "(SELECT uniqExact(layer) FROM unit_stats) AS layers"
    ).to_pylist()
    assert counts == [{"raw": SENTENCES * 18, "norms": SENTENCES * 12, "layers": 6}]

    # The raw capture is exactly what the module computed, padding cut off.
    model, tokenizer = minilm.load()
    ids, mask = minilm.encode(tokenizer, run.sentences(SENTENCES)[:16])
    captured: dict[str, torch.Tensor] = {}
    handle = model.encoder.layer[2].attention.self.query.register_forward_hook(
        lambda _m, _i, out: captured.setdefault("q", out.detach().clone())
    )
    with torch.inference_mode():
        model(ids, mask)
    handle.remove()
    real_tokens = int(mask[3].sum())
    expected = captured["q"][3, :real_tokens].numpy().ravel()
    row = query(
        "SELECT values, values_shape FROM raw_activations "
        "WHERE hook = 'encoder.layer.2.attention.self.query' AND key = 3"
    ).to_pylist()
    assert len(row) == 1 and row[0]["values_shape"] == [real_tokens, 384]  # the real shape
    np.testing.assert_allclose(
        np.array(row[0]["values"], np.float32), expected, rtol=1e-5, atol=1e-5
    )

    # Welford over every real token of a layer equals the plain mean/variance.
    stats = query(
        "SELECT count, mean, variance FROM unit_stats WHERE layer = 0 ORDER BY count DESC LIMIT 1"
    ).to_pylist()[0]
    total_tokens = sum(
        int(m.sum())
        for start in range(0, SENTENCES, 16)
        for m in [minilm.encode(tokenizer, run.sentences(SENTENCES)[start : start + 16])[1]]
    )
    assert stats["count"] == total_tokens
