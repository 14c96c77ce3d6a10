"""Which modules stage 3 shards as separate FSDP2 units (embedding, blocks, norm + head)."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_llmopt.models import Llama, LlamaConfig
from lightning_llmopt.strategies.zero_fsdp import edge_modules, transformer_blocks


class Holder(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


def test_edges_of_our_llama() -> None:
    model = Llama(LlamaConfig.from_preset("tiny"))
    embedding, head = edge_modules(Holder(model))
    assert embedding is model.tok_embeddings
    assert head == [model.norm, model.output]
    assert transformer_blocks(Holder(model)) == list(model.layers.values())


def test_tied_embeddings_stay_in_the_root() -> None:
    model = Llama(LlamaConfig.from_preset("tiny", tie_embeddings=True))
    assert model.output.weight is model.tok_embeddings.weight
    assert edge_modules(Holder(model)) == (None, [])


def test_pipeline_stage_without_embedding() -> None:
    model = Llama(LlamaConfig.from_preset("tiny"))
    model.tok_embeddings = None
    embedding, head = edge_modules(Holder(model))
    assert embedding is None and head == [model.norm, model.output]


def test_edges_of_transformers_llama() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config)
    embedding, head = edge_modules(Holder(model))
    assert embedding is model.model.embed_tokens
    assert head == [model.model.norm, model.lm_head]
