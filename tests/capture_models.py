"""Tiny real models for the capture tests: transformers configs with random
weights (never downloaded), MiniLM from its weights package, and plain torch
hooks that take reference values independently of taproute."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    logging,
)

from taproute.routing import Layout, RecordSchema
from taproute.service import RecordBatch

logging.set_verbosity_error()  # tiny vocabularies make transformers warn about token ids

ACTS = Layout("acts", [("values", "Array(Float32)")])
VOCAB = 100


def gpt2(layers: int = 2, hidden: int = 32, attention: str = "sdpa") -> GPT2LMHeadModel:
    """A GPT-2 (``attention="eager"``: its attention modules return their weights
    when the model is called with ``output_attentions=True``)."""
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=layers,
        n_embd=hidden,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=128,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        attn_implementation=attention,
    )
    return GPT2LMHeadModel(config).eval()


def llama(attention: str = "sdpa") -> LlamaForCausalLM:
    """A 2-layer Llama (grouped-query attention: K projections narrower than Q)."""
    torch.manual_seed(5)
    config = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        attn_implementation=attention,
    )
    return LlamaForCausalLM(config).eval()


def qwen2_moe(experts: int = 8, top_k: int = 2) -> Qwen2MoeForCausalLM:
    torch.manual_seed(1)
    config = Qwen2MoeConfig(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=experts,
        num_experts_per_tok=top_k,
        vocab_size=VOCAB,
    )
    return Qwen2MoeForCausalLM(config).eval()


def mixtral(experts: int = 4, top_k: int = 2) -> MixtralForCausalLM:
    torch.manual_seed(2)
    config = MixtralConfig(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        vocab_size=VOCAB,
    )
    return MixtralForCausalLM(config).eval()


class Reference:
    """Plain torch forward hooks keeping a copy of each call's output, by module name."""

    def __init__(
        self, model: nn.Module, names: list[str], take: Callable[[Any], torch.Tensor]
    ) -> None:
        self.calls: dict[str, list[torch.Tensor]] = defaultdict(list)
        self._handles = []
        modules = dict(model.named_modules())
        for name in names:
            self._handles.append(
                modules[name].register_forward_hook(
                    lambda _m, _i, out, name=name: self.calls[name].append(
                        take(out).detach().clone()
                    )
                )
            )

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def records_by_hook(batches: list[RecordBatch], hooks: Any) -> dict[str, list[tuple]]:
    """(key, step, values as float32/raw numpy) of every record, by hook name, in order."""
    out: dict[str, list[tuple]] = defaultdict(list)
    for batch in batches:
        for row in range(len(batch)):
            desc = batch.descriptors[row]
            name = hooks.name_of(int(desc["output_id"]))
            out[name].append((int(desc["key"]), int(desc["step"]), batch.payload_of(row)))
    return out


def as_float32(payload: Any) -> np.ndarray:
    return np.asarray(payload).view(np.float32)


def schema(*layouts: Layout) -> RecordSchema:
    return RecordSchema(list(layouts) or [ACTS])
