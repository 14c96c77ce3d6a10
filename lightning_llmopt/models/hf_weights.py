"""Parameter-name mapping between :class:`~lightning_llmopt.models.Llama` and Hugging Face Llama/Mistral/Qwen2.

The mapping is a pure rename: our RoPE uses the same "rotate half" channel layout as transformers, so q/k weights
need no permutation. ``w1``/``w2``/``w3`` are ``gate_proj``/``down_proj``/``up_proj``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from torch import Tensor

from lightning_llmopt.models.config import LlamaConfig

_TOP_LEVEL: dict[str, str] = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_PER_LAYER: dict[str, str] = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}
_BIASES: dict[str, str] = {
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
}
# Buffers some transformers versions keep in the state dict; they are recomputed, never loaded.
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def key_map(config: LlamaConfig) -> dict[str, str]:
    """``{our name: HF name}`` for every parameter of a model with ``config`` (``output.weight`` included)."""
    if config.mla is not None:
        from lightning_llmopt.models.hf_deepseek import deepseek_key_map

        return deepseek_key_map(config)
    per_layer = dict(_PER_LAYER)
    if config.qkv_bias:
        per_layer.update(_BIASES)
    names = dict(_TOP_LEVEL)
    for i in range(config.n_layers):
        names.update({f"layers.{i}.{ours}": f"model.layers.{i}.{theirs}" for ours, theirs in per_layer.items()})
    return names


def expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """``{our name: shape}`` for every parameter of a model with ``config``."""
    assert config.head_dim is not None and config.n_kv_heads is not None and config.ffn_hidden_dim is not None
    q, kv = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    d, f, v = config.dim, config.ffn_hidden_dim, config.vocab_size
    per_layer = {
        "attention_norm.weight": (d,), "attention.wq.weight": (q, d), "attention.wk.weight": (kv, d),
        "attention.wv.weight": (kv, d), "attention.wo.weight": (d, q), "ffn_norm.weight": (d,),
        "feed_forward.w1.weight": (f, d), "feed_forward.w2.weight": (d, f), "feed_forward.w3.weight": (f, d),
        "attention.wq.bias": (q,), "attention.wk.bias": (kv,), "attention.wv.bias": (kv,),
    }
    shapes = {"tok_embeddings.weight": (v, d), "norm.weight": (d,), "output.weight": (v, d)}
    for i in range(config.n_layers):
        shapes.update({f"layers.{i}.{name}": shape for name, shape in per_layer.items()})
    return shapes


def _check_shapes(sd: Mapping[str, Tensor], config: LlamaConfig, names: Mapping[str, str] | None = None) -> None:
    shapes = expected_shapes(config)
    bad = [
        f"{names[k] if names else k}: {tuple(t.shape)} (expected {shapes[k]})"
        for k, t in sd.items() if tuple(t.shape) != shapes[k]
    ]
    if bad:
        raise ValueError(f"{len(bad)} tensor(s) have the wrong shape for the config: " + "; ".join(bad))


def _with_prefix(hf_sd: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Add the ``model.`` prefix of ``*ForCausalLM`` when the keys come from a bare ``*Model``."""
    if any(k.startswith("model.") for k in hf_sd):
        return dict(hf_sd)
    return {k if k == "lm_head.weight" else f"model.{k}": v for k, v in hf_sd.items()}


def state_dict_from_hf(hf_sd: Mapping[str, Tensor], config: LlamaConfig) -> dict[str, Tensor]:
    """Rename a transformers Llama/Mistral/Qwen2 state dict to :class:`Llama` names (tensors are not copied).

    Keys may carry the ``model.`` prefix of ``*ForCausalLM`` or not (a bare ``*Model``); ``rotary_emb.inv_freq``
    buffers are ignored. With ``config.tie_embeddings`` ``lm_head.weight`` may be absent and ``output.weight`` is
    the embedding tensor itself. Raises ``KeyError`` listing unknown and missing keys, ``ValueError`` listing
    wrong shapes.
    """
    hf = {k: v for k, v in _with_prefix(hf_sd).items() if not _IGNORED.search(k)}
    names = key_map(config)
    ours_of = {theirs: ours for ours, theirs in names.items()}
    if config.tie_embeddings:
        hf.pop("lm_head.weight", None)  # transformers' state_dict() lists the tied head; it equals the embedding
    unknown = sorted(k for k in hf if k not in ours_of)
    required = [theirs for ours, theirs in names.items() if not (config.tie_embeddings and ours == "output.weight")]
    missing = [k for k in required if k not in hf]
    if unknown or missing:
        raise KeyError(f"checkpoint does not match the config: unknown keys {unknown[:20]}"
                       f"{' ...' if len(unknown) > 20 else ''}, missing keys {missing[:20]}"
                       f"{' ...' if len(missing) > 20 else ''}")
    sd = {ours_of[k]: v for k, v in hf.items()}
    if config.tie_embeddings:
        sd["output.weight"] = sd["tok_embeddings.weight"]
    if config.mla is not None:  # DeepSeek: shapes checked, RoPE rows to our layout
        from lightning_llmopt.models.hf_deepseek import deepseek_state_dict_from_hf

        return deepseek_state_dict_from_hf(sd, config)
    _check_shapes(sd, config, names)
    return sd


def state_dict_to_hf(sd: Mapping[str, Tensor], config: LlamaConfig) -> dict[str, Tensor]:
    """Rename a :class:`Llama` state dict to transformers ``*ForCausalLM`` names (tensors are not copied).

    With ``config.tie_embeddings`` no ``lm_head.weight`` is written (transformers re-ties it on load). Raises
    ``KeyError`` listing unknown and missing keys, ``ValueError`` listing wrong shapes.
    """
    names = key_map(config)
    sd = {k: v for k, v in sd.items() if k != "rope"}
    if config.tie_embeddings:
        sd.pop("output.weight", None)
    unknown = sorted(k for k in sd if k not in names)
    missing = [k for k in names if k not in sd and not (config.tie_embeddings and k == "output.weight")]
    if unknown or missing:
        raise KeyError(f"state dict does not match the config: unknown keys {unknown[:20]}, "
                       f"missing keys {missing[:20]}")
    if config.mla is not None:  # DeepSeek: shapes checked, RoPE rows to its layout
        from lightning_llmopt.models.hf_deepseek import deepseek_state_dict_to_hf

        sd = deepseek_state_dict_to_hf(sd, config)
    else:
        _check_shapes(sd, config)
    return {names[k]: v for k, v in sd.items()}
