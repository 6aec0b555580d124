"""Signal processors vs the per-record numpy a user would write, in one run.

Each taproute processor (``taproute.service.signals``) is called on a batch
of MiniLM-sized records the way a route calls it (one ``Records`` batch, a
``StateRegion`` for stateful ones); its peer loops over the same records one
at a time with numpy (heads stacked per record: that much batching is
natural), doing the same work and producing the same figures.  Both stop
when the batch's rows are computed.  A sample is the rate over as many
back-to-back calls as fill ``MIN_SAMPLE_SECONDS`` (at least one), for both
alike: some batched calls take a millisecond or two, which timed alone
measured cold caches and preemption more than the call.  One core: BLAS and torch threads are
pinned to 1 before numpy loads.

Also measured: the Q/K rate on one core against the rate at which MiniLM
itself produces Q/K captures on one core (the demo's capture rate), so the
reader sees whether the processor keeps up.
"""

from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import math  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402

import harness  # noqa: E402
import numpy as np  # noqa: E402

from taproute.native import StateRegion, make_descriptors  # noqa: E402
from taproute.routing import RecordBatch, Records  # noqa: E402
from taproute.routing.processors import REGISTRY  # noqa: E402
from taproute.service.signals import experts, pathways, qk, twonn  # noqa: E402
from taproute.service.signals.common import tail_layout  # noqa: E402

#: Imported for their registrations (the processors the bench calls by name).
SIGNALS = (qk.SIGNALS, experts.SIGNALS, pathways.SIGNALS, twonn.SIGNALS)

HIDDEN, HEADS, TOP_K = 384, 12, 8

#: The shortest sample: calls are repeated back to back until it has passed.
MIN_SAMPLE_SECONDS = 0.2


def records_of(arrays: list[np.ndarray], hook: str = "encoder.layer.1.x") -> Records:
    payload = np.concatenate([a.reshape(-1) for a in arrays]).astype(np.float32)
    desc = make_descriptors(0, [a.size * 4 for a in arrays], keys=np.arange(len(arrays)))
    return Records(RecordBatch.from_buffer(desc, payload), tail_layout("x"), lambda _: hook)


def stateful(name: str, records: Records):
    """A timed call of stateful processor ``name`` on a fresh state region
    (allocated before the clock starts: that is route setup, not per batch)."""
    spec = REGISTRY.get(name)
    state = StateRegion(spec.key_range, spec.slot.shape, spec.slot.dtype, 1)
    keys = spec.key(records.descriptors)
    return lambda: spec.fn(records, keys, state)


# -- peers: per record, numpy ----------------------------------------------------


def peer_qk(arrays: list[np.ndarray]) -> list[dict[str, np.ndarray]]:
    d = HIDDEN // HEADS
    out = []
    for a in arrays:
        t = len(a)
        q = a[:, :HIDDEN].astype(np.float64).reshape(t, HEADS, d).transpose(1, 0, 2)
        k = a[:, HIDDEN:].astype(np.float64).reshape(t, HEADS, d).transpose(1, 0, 2)
        scores = q @ k.transpose(0, 2, 1) / math.sqrt(d)
        sv = np.linalg.svd(scores, compute_uv=False)
        p = sv / sv.sum(-1, keepdims=True)
        erank = np.exp(-(p * np.log(np.where(p > 0, p, 1))).sum(-1))
        stable = (sv**2).sum(-1) / sv[:, 0] ** 2
        masked = np.where(np.triu(np.ones((t, t), bool), 1), -np.inf, scores)
        probs = np.exp(masked - masked.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        logp = np.log(np.where(probs > 0, probs, 1))
        entropy = -(probs * logp).sum(-1)[:, 1:]
        out.append(
            {
                "sv": sv[:, :TOP_K],
                "erank": erank,
                "stable": stable,
                "entropy_mean": entropy.mean(-1),
                "entropy_min": entropy.min(-1),
            }
        )
    return out


def peer_experts(arrays: list[np.ndarray], top_k: int = 2, window: int = 64) -> list[dict]:
    e = arrays[0].shape[1]
    rows, acc = [], None
    for i, logits in enumerate(arrays):
        if acc is None:
            acc = {"counts": np.zeros(e), "prob": np.zeros(e), "tokens": 0, "ent": 0.0,
                   "margin": 0.0, "over": 0.0}  # fmt: skip
        x = logits.astype(np.float64)
        p = np.exp(x - x.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        top = np.argsort(-x, axis=1, kind="stable")[:, :top_k]
        counts = np.bincount(top.reshape(-1), minlength=e)
        sp = np.sort(p, axis=1)
        acc["counts"] += counts
        acc["prob"] += p.sum(0)
        acc["tokens"] += len(x)
        acc["ent"] += -(p * np.log(p)).sum()
        acc["margin"] += (sp[:, -1] - sp[:, -2]).sum()
        acc["over"] += np.maximum(counts - math.floor(1.25 * len(x) * top_k / e), 0).sum()
        if (i + 1) % window == 0:
            f = acc["counts"] / (acc["tokens"] * top_k)
            prob = acc["prob"] / acc["tokens"]
            rows.append({"balance": e * (f * prob).sum(), "dead": int((f == 0).sum())})
            acc = None
    return rows


def peer_pathways(arrays: list[np.ndarray], layers: int = 4, experts_: int = 8) -> dict:
    transitions = np.zeros((layers - 1, experts_, experts_), dtype=np.int64)
    paths: Counter[tuple[int, ...]] = Counter()
    for logits in arrays:
        top1 = logits.reshape(-1, layers, experts_).argmax(-1)
        for layer in range(layers - 1):
            np.add.at(transitions[layer], (top1[:, layer], top1[:, layer + 1]), 1)
        paths.update(map(tuple, top1.tolist()))
    total = sum(paths.values())
    p = np.array(list(paths.values())) / total
    return {
        "transitions": transitions,
        "top": paths.most_common(16),
        "entropy": -(p * np.log(p)).sum(),
    }


def peer_two_nn(x: np.ndarray, discard: float = 0.1) -> float:
    """TwoNN as a user writes it: squared distances from the Gram matrix, rows sorted."""
    sq = (x * x).sum(1)
    d2 = np.maximum(sq[:, None] + sq[None, :] - 2 * x @ x.T, 0)
    nearest = np.sqrt(np.sort(d2, axis=1)[:, 1:3])  # column 0 is the point itself
    mu = np.sort(nearest[:, 1] / nearest[:, 0])
    used = int(len(mu) * (1 - discard))
    xs = np.log(mu[:used])
    ys = -np.log(1 - np.arange(1, used + 1) / len(mu))
    return float((xs * ys).sum() / (xs * xs).sum())


def peer_twonn(arrays: list[np.ndarray], sample: int = 2000, window: int = 64) -> list[float]:
    out, reservoir, seen = [], [], 0
    rng = random.Random(0)
    for i, tokens in enumerate(arrays):
        for vector in tokens:  # Algorithm R, the textbook way
            if seen < sample:
                reservoir.append(vector)
            else:
                j = rng.randint(0, seen)
                if j < sample:
                    reservoir[j] = vector
            seen += 1
        if (i + 1) % window == 0:
            out.append(peer_two_nn(np.array(reservoir, dtype=np.float64)))
            reservoir, seen = [], 0
    return out


# -- the run -----------------------------------------------------------------------


def minilm_qk_rate(sentences: int) -> float | None:
    """Q/K captures per second MiniLM itself produces on one core (6 per sentence)."""
    try:
        import torch

        from taproute.service.demo import minilm
        from taproute.service.demo.run import sentences as demo_sentences
    except ImportError:
        return None
    try:
        model, tokenizer = minilm.load()
    except Exception:
        return None
    torch.set_num_threads(1)
    texts = demo_sentences(sentences)
    started = time.perf_counter()
    with torch.inference_mode():
        for start in range(0, len(texts), 16):
            ids, mask = minilm.encode(tokenizer, texts[start : start + 16])
            model(ids, mask)
    return 6 * len(texts) / (time.perf_counter() - started)


def main() -> None:
    args = harness.arguments(__doc__, records=(256, 64), long_tokens=(128, 128))
    rng = np.random.default_rng(0)
    n = args.records
    lengths = rng.integers(8, 20, size=n)  # the demo's sentences: 8..19 tokens
    qk_short = [rng.normal(size=(t, 2 * HIDDEN)).astype(np.float32) for t in lengths]
    qk_long = [
        rng.normal(size=(args.long_tokens, 2 * HIDDEN)).astype(np.float32) for _ in range(n // 8)
    ]
    router = [rng.normal(size=(t * 4, 8)).astype(np.float32) for t in lengths]
    path = [rng.normal(size=(t * 4, 32)).astype(np.float32) for t in lengths]
    hidden = [rng.normal(size=(t * 4, HIDDEN)).astype(np.float32) for t in lengths]
    batches = {name: records_of(arrays) for name, arrays in
               (("qk_short", qk_short), ("qk_long", qk_long), ("router", router),
                ("path", path), ("hidden", hidden))}  # fmt: skip

    def rate(count: int, body) -> float:
        # Some calls take a millisecond or two: each sample is as many back to
        # back calls as fill MIN_SAMPLE_SECONDS, for taproute and peer alike.
        return harness.timed_rate(count, body, min_seconds=MIN_SAMPLE_SECONDS)

    spectra = REGISTRY.get("signals.qk_spectra").fn
    variants = {
        "qk_short.taproute": lambda: rate(n, lambda: spectra(batches["qk_short"])),
        "qk_short.numpy": lambda: rate(n, lambda: peer_qk(qk_short)),
        "qk_long.taproute": lambda: rate(n // 8, lambda: spectra(batches["qk_long"])),
        "qk_long.numpy": lambda: rate(n // 8, lambda: peer_qk(qk_long)),
        "experts.taproute": lambda: rate(n, stateful("signals.expert_health", batches["router"])),
        "experts.numpy": lambda: rate(n, lambda: peer_experts(router)),
        "pathways.taproute": lambda: rate(n, stateful("signals.pathways", batches["path"])),
        "pathways.numpy": lambda: rate(n, lambda: peer_pathways(path)),
        "twonn.taproute": lambda: rate(
            n, stateful("signals.intrinsic_dimension", batches["hidden"])
        ),
        "twonn.numpy": lambda: rate(n, lambda: peer_twonn(hidden)),
    }
    results = harness.interleave(variants, repeat=args.repeat, warmup=1)
    comparisons, targets = [], []
    for what, label in (
        ("qk_short", f"Q/K spectra, {n} records of 8-19 tokens"),
        ("qk_long", f"Q/K spectra, {n // 8} records of {args.long_tokens} tokens"),
        ("experts", f"expert health, {n} records of 32-76 tokens x 8 experts"),
        ("pathways", f"pathways, {n} records, 4 layers x 8 experts"),
        ("twonn", f"TwoNN reservoir + estimate, {n} records x 384"),
    ):
        ours, peer = results[f"{what}.taproute"], results[f"{what}.numpy"]
        comparisons.append(
            harness.comparison(label, ours, peer, taproute_label="taproute (batched)",
                               peer_label="per-record numpy", unit="records/s")
        )  # fmt: skip
        speedup = ours["median"] / peer["median"]
        targets.append(harness.target(f"{what} >= 5x per-record numpy", speedup >= 5,
                                      f"{speedup:.1f}x"))  # fmt: skip
    capture_rate = minilm_qk_rate(64 if args.quick else 320)
    notes = []
    qk_rate = results["qk_short.taproute"]["median"]
    if capture_rate is not None:
        targets.append(
            harness.target(
                "Q/K spectra keep up with MiniLM's Q/K capture rate on one core",
                qk_rate >= capture_rate,
                f"{harness.fmt(qk_rate)} records/s processed vs {harness.fmt(capture_rate)} "
                "Q/K records/s produced",
            )
        )
        notes.append(
            f"On one core MiniLM produces {harness.fmt(capture_rate)} Q/K captures/s "
            f"(6 per sentence); signals.qk_spectra processes {harness.fmt(qk_rate)} records/s "
            f"of the same size ({qk_rate / capture_rate:.1f}x headroom)."
        )
    harness.write_result(
        "signals",
        title="Signal processors vs per-record numpy",
        description=__doc__.split("\n\n")[0],
        params={
            "records": n,
            "long_tokens": args.long_tokens,
            "repeat": args.repeat,
            "min_sample_seconds": MIN_SAMPLE_SECONDS,
            "threads": 1,
        },
        quick=args.quick,
        comparisons=comparisons,
        targets=targets,
        notes=notes,
        raw={"minilm_qk_captures_per_s": capture_rate},
    )


if __name__ == "__main__":
    main()
