"""Tensor-parallel plan tables, one per model family: where the embedding, blocks, norms, projections and head live.

A :class:`ModelFamily` names the submodules that :func:`~lightning_llmopt.parallel.tensor_parallel.apply_tp`
parallelises and reads the shapes it validates. Families registered here:

- ``"llmopt-llama"``: :class:`lightning_llmopt.models.Llama` (Llama 2/3, Mistral, Qwen2 shapes);
- ``"hf-llama"``: transformers' ``LlamaForCausalLM``, ``MistralForCausalLM`` and ``Qwen2ForCausalLM`` (one layout).

Other families register with :func:`register_family` (the first family whose ``matches`` accepts the model wins).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = ["FAMILIES", "ModelFamily", "ModelShape", "find_family", "register_family"]

HF_CAUSAL_LMS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True)
class ModelShape:
    """The sizes tensor parallelism must divide."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    ffn_hidden_dim: int
    tie_embeddings: bool


@dataclass(frozen=True)
class ModelFamily:
    """Where a decoder family keeps its parts (dotted paths relative to the model or to one block).

    Arguments:
        name: family name.
        matches: ``matches(model)`` is True for models of this family.
        shape: reads a :class:`ModelShape` from a model.
        embedding, blocks, final_norm, head: paths from the model (``blocks``: a ModuleList/ModuleDict of blocks).
        attention, attention_norm, mlp, mlp_norm: paths from a block.
        q, k, v, o: paths from the attention module; gate, up, down: from the MLP.
        attention_kwarg: the attention module receives its hidden states as this keyword (transformers) instead
            of as the first of ``attention_args`` positional arguments (ours).
        attention_args: number of positional arguments of the attention module's ``forward``.
        kv_groups_attr: attribute of the attention module holding query heads per kv head, updated for local heads.
    """

    name: str
    matches: Callable[[nn.Module], bool]
    shape: Callable[[nn.Module], ModelShape]
    embedding: str
    blocks: str
    final_norm: str
    head: str
    attention: str
    attention_norm: str
    mlp: str
    mlp_norm: str
    q: str
    k: str
    v: str
    o: str
    gate: str
    up: str
    down: str
    attention_kwarg: str | None = None
    attention_args: int = 1
    kv_groups_attr: str | None = None


def _llama_shape(model: nn.Module) -> ModelShape:
    cfg: Any = model.config
    return ModelShape(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.vocab_size, cfg.ffn_hidden_dim, cfg.tie_embeddings)


def _is_llama(model: nn.Module) -> bool:
    from lightning_llmopt.models.llama import Llama

    return isinstance(model, Llama)


def _hf_shape(model: nn.Module) -> ModelShape:
    cfg: Any = model.config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    return ModelShape(heads, kv, head_dim, cfg.vocab_size, cfg.intermediate_size, tied)


def _is_hf_llama(model: nn.Module) -> bool:
    return type(model).__name__ in HF_CAUSAL_LMS and hasattr(model, "config") and hasattr(model, "lm_head")


FAMILIES: list[ModelFamily] = [
    ModelFamily(
        name="llmopt-llama",
        matches=_is_llama,
        shape=_llama_shape,
        embedding="tok_embeddings",
        blocks="layers",
        final_norm="norm",
        head="output",
        attention="attention",
        attention_norm="attention_norm",
        mlp="feed_forward",
        mlp_norm="ffn_norm",
        q="wq",
        k="wk",
        v="wv",
        o="wo",
        gate="w1",
        up="w3",
        down="w2",
        attention_args=5,  # (x, rope, positions, mask, kv_cache)
    ),
    ModelFamily(
        name="hf-llama",
        matches=_is_hf_llama,
        shape=_hf_shape,
        embedding="model.embed_tokens",
        blocks="model.layers",
        final_norm="model.norm",
        head="lm_head",
        attention="self_attn",
        attention_norm="input_layernorm",
        mlp="mlp",
        mlp_norm="post_attention_layernorm",
        q="q_proj",
        k="k_proj",
        v="v_proj",
        o="o_proj",
        gate="gate_proj",
        up="up_proj",
        down="down_proj",
        attention_kwarg="hidden_states",
        kv_groups_attr="num_key_value_groups",
    ),
]


def register_family(family: ModelFamily, *, first: bool = False) -> None:
    """Add a plan table (``first=True`` puts it ahead of the built-in ones)."""
    if any(f.name == family.name for f in FAMILIES):
        raise ValueError(f"a model family named {family.name!r} is already registered")
    FAMILIES.insert(0, family) if first else FAMILIES.append(family)


def find_family(model: nn.Module) -> ModelFamily:
    """The plan table for ``model``; ``ValueError`` naming the class and the known families otherwise."""
    mla = getattr(getattr(model, "config", None), "mla", None)
    if mla is not None:
        raise ValueError(f"tensor parallelism has no plan for multi-head latent attention (config.mla = {mla})")
    for family in FAMILIES:
        if family.matches(model):
            return family
    raise ValueError(
        f"no tensor-parallel plan for {type(model).__name__}; known families: "
        f"{[f.name for f in FAMILIES]} (lightning_llmopt Llama, transformers {list(HF_CAUSAL_LMS)}); "
        "add one with lightning_llmopt.parallel.tp_plans.register_family"
    )
