"""The example inference server (bench/inference_server.py) with capture on:
real HTTP on loopback, concurrent requests batched dynamically, answers
checked against direct model calls, ClickHouse rows counted exactly per
route, per-request summaries checked against the raw captures."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from bench.inference_server import MINILM, Gpt2Size, InferenceServer, ServerConfig  # noqa: E402
from bench.server_capture import summaries_from_raw  # noqa: E402

TINY = Gpt2Size(layers=2, hidden=48, heads=12, positions=128)
SENTENCES = [
    "The cat sat on the mat.",
    "A GPU kernel that never finishes.",
    "Three quiet songs at night.",
    "The server answers every request.",
    "An engineer repairs the old bridge near the river.",
    "Lemon cake.",
]
# The reference calls run the server's own (hooked) models outside any capture
# context on purpose: nothing is captured and taproute says so once per hook.
outside_capture = pytest.mark.filterwarnings(
    "ignore::taproute.service.capture.errors.CaptureWarning"
)
PROMPTS = ["The model reads", "A child paints the map of a city", "Tides", "My neighbour builds"]


def _post(url: str, body: object) -> tuple[int, dict]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.fixture(scope="module")
def served(chdb_transport):
    server = InferenceServer(
        ServerConfig(
            transport=chdb_transport,
            table_prefix="srv_",
            gpt2=TINY,
            batch_window_s=0.005,
            embed_max_batch=8,
            generate_max_batch=4,
        )
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def answered(served):
    """Three dozen concurrent requests; then a flush report."""
    embeds = [SENTENCES[i % 6 : i % 6 + 1 + i % 3] for i in range(24)]
    generates = [(PROMPTS[i % 4], 2 + i % 5) for i in range(12)] * 2  # every request twice
    with ThreadPoolExecutor(16) as pool:
        embed_futures = [pool.submit(_post, served.url + "/embed", {"input": t}) for t in embeds]
        generate_futures = [
            pool.submit(_post, served.url + "/generate", {"prompt": p, "max_new_tokens": n})
            for p, n in generates
        ]
        embed_answers = [f.result() for f in embed_futures]
        generate_answers = [f.result() for f in generate_futures]
    status, report = _post(served.url + "/admin/flush", {})
    assert status == 200
    return embeds, embed_answers, generates, generate_answers, report


@outside_capture
def test_embeddings_equal_a_direct_model_call(served, answered):
    from taproute.service.demo import minilm

    embeds, answers, *_ = answered
    assert {status for status, _ in answers} == {200}
    assert max(served.embedder.batch_sizes) > 1  # concurrent requests were batched
    for texts, (_, body) in zip(embeds, answers, strict=True):
        assert body["object"] == "list" and body["model"] == "all-MiniLM-L6-v2"
        assert [d["index"] for d in body["data"]] == list(range(len(texts)))
        ids, mask = minilm.encode(served.models.tokenizer, list(texts))
        with torch.inference_mode():
            direct = minilm.MiniLM.embed(served.models.minilm(ids, mask), mask).numpy()
        got = np.array([d["embedding"] for d in body["data"]], dtype=np.float32)
        np.testing.assert_allclose(got, direct, atol=2e-6)
        assert body["usage"]["prompt_tokens"] == int(mask.sum())


@outside_capture
def test_greedy_generation_is_deterministic_and_equals_full_recomputation(served, answered):
    *_, generates, answers, _ = answered
    assert {status for status, _ in answers} == {200}
    assert max(served.generator.batch_sizes) > 1
    by_request: dict[tuple[str, int], list[list[int]]] = defaultdict(list)
    for (prompt, new), (_, body) in zip(generates, answers, strict=True):
        assert len(body["token_ids"]) == new == body["usage"]["completion_tokens"]
        by_request[(prompt, new)].append(body["token_ids"])
    model, tokenizer = served.models.gpt2, served.models.tokenizer
    for (prompt, new), outputs in by_request.items():
        assert all(o == outputs[0] for o in outputs), (prompt, outputs)
        # Reference: recompute the whole sequence at every step (no KV cache,
        # no batch, no padding) and take the argmax.
        sequence = torch.tensor([tokenizer.encode(prompt).ids])
        prompt_length = sequence.shape[1]
        with torch.inference_mode():
            for _ in range(new):
                logits = model(sequence).logits[0, -1]
                sequence = torch.cat([sequence, logits.argmax().view(1, 1)], dim=1)
        assert outputs[0] == sequence[0, prompt_length:].tolist(), prompt


def test_clickhouse_rows_per_route_counted_exactly(served, answered):
    embeds, _, generates, _, report = answered
    # What the server ran, computed here from the requests alone: one MiniLM
    # row per input; one GPT-2 row per forward pass (prefill + new - 1 steps).
    minilm_rows = sum(len(t) for t in embeds)
    gpt2_rows = sum(new for _, new in generates)
    assert report["captured_rows"] == {"minilm": minilm_rows, "gpt2": gpt2_rows}
    raw = 2 * minilm_rows + TINY.layers * gpt2_rows
    heads = raw  # one head_norms row per query capture; as many as hidden ones here
    requests = len(embeds) + len(generates)
    assert report["clickhouse_rows"] == {"raw": raw, "head_norms": heads, "summary": requests}
    assert report["routes"]["raw"] == {"processed": raw, "emitted": raw, "failed": 0}
    assert report["routes"]["head_norms"]["emitted"] == heads
    assert report["rejected"] == report["shed"] == 0 and report["dropped"] == {}
    assert report["failure"] is None


def test_summaries_equal_summaries_of_the_raw_captures(served, answered, chdb_transport):
    *_, report = answered
    assert report["clickhouse_rows"]["summary"] > 0
    last = {"minilm." + MINILM.summary: MINILM.width, "gpt2." + TINY.hooks().summary: TINY.hidden}
    raw = chdb_transport.query(
        "SELECT hook, key, values FROM srv_raw_activations "
        f"WHERE hook IN ({', '.join(repr(h) for h in last)}) ORDER BY key, step, seq"
    ).to_pylist()
    captures: dict[int, list] = defaultdict(list)
    width_of: dict[int, int] = {}
    for row in raw:
        captures[row["key"]].append(np.asarray(row["values"], dtype=np.float32))
        width_of[row["key"]] = last[row["hook"]]
    summaries = chdb_transport.query("SELECT * FROM srv_request_summary").to_pylist()
    assert sorted(s["request"] for s in summaries) == sorted(captures)
    for s in summaries:
        records, tokens, mean, peak = summaries_from_raw(
            captures[s["request"]], width_of[s["request"]]
        )
        assert (s["records"], s["tokens"]) == (records, tokens)
        assert s["norm_mean"] == pytest.approx(mean, rel=1e-9)
        assert s["norm_max"] == pytest.approx(peak, rel=1e-9)


def test_metrics_show_server_and_taproute_side_by_side(served, answered):
    embeds, _, generates, _, report = answered
    with urllib.request.urlopen(served.url + "/metrics", timeout=60) as response:
        text = response.read().decode()
    assert f'server_requests_total{{endpoint="embed",status="200"}} {len(embeds)}.0' in text
    assert f'server_requests_total{{endpoint="generate",status="200"}} {len(generates)}.0' in text
    raw = report["routes"]["raw"]["processed"]
    assert (
        'taproute_route_processed_records_total{destination="clickhouse",mode="forward",'
        f'route="raw"}} {raw}.0'
    ) in text


def test_bad_requests_get_a_clear_400(served):
    status, body = _post(served.url + "/generate", {"prompt": "hi", "max_new_tokens": 0})
    assert status == 400 and "max_new_tokens" in body["error"] and "got 0" in body["error"]
    status, body = _post(served.url + "/embed", {"input": ["ok", ""]})
    assert status == 400 and '"input"' in body["error"]
    status, body = _post(served.url + "/embed", [1, 2])
    assert status == 400 and "JSON object" in body["error"]


def test_writer_process_server_counts_every_row(tmp_path):
    """The same server with chDB in a writer process (``writer="process"``,
    what ``serve_load.py`` measures): hooks copy into its shared memory, rows
    are counted exactly in ClickHouse, nothing shed."""
    server = InferenceServer(
        ServerConfig(data=tmp_path / "chdb", writer="process", gpt2=TINY, generate_max_batch=4)
    )
    server.start()
    try:
        embeds = [SENTENCES[i % 6 : i % 6 + 1 + i % 2] for i in range(6)]
        generates = [(PROMPTS[i % 4], 2 + i % 3) for i in range(6)]
        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(_post, server.url + "/embed", {"input": t}) for t in embeds]
            futures += [
                pool.submit(_post, server.url + "/generate", {"prompt": p, "max_new_tokens": n})
                for p, n in generates
            ]
            assert {f.result()[0] for f in futures} == {200}
        status, report = _post(server.url + "/admin/flush", {})
    finally:
        server.stop()
    assert status == 200
    minilm_rows = sum(len(t) for t in embeds)
    gpt2_rows = sum(n for _, n in generates)
    raw = 2 * minilm_rows + TINY.layers * gpt2_rows
    assert report["clickhouse_rows"] == {
        "raw": raw,
        "head_norms": raw,
        "summary": len(embeds) + len(generates),
    }
    assert report["shed"] == 0 and report["failure"] is None


def test_writer_process_refuses_a_shared_transport(chdb_transport):
    with pytest.raises(ValueError, match="writer='process'"):
        InferenceServer(ServerConfig(transport=chdb_transport, writer="process", gpt2=TINY))
