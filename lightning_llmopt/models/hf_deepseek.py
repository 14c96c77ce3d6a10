"""Hugging Face interop for DeepSeek-V2/V3-style MLA models (transformers ``DeepseekV2*`` / ``DeepseekV3*``).

What maps onto :class:`~lightning_llmopt.models.Llama` with ``config.mla``: the MLA attention (``q_lora_rank`` None
or set), dense SwiGLU MLPs, RMSNorm, RoPE of the kinds :mod:`~lightning_llmopt.models.hf_rope` reads (default,
linear, llama3), tied or untied embeddings. What does not is refused by name before any weight is read:

- DeepSeek MoE layers (``n_routed_experts`` with ``first_k_dense_replace < num_hidden_layers``): their dense-first
  layer pattern, shared experts and (V3) grouped sigmoid routing with a scaling factor do not map onto
  :mod:`~lightning_llmopt.models.moe`;
- YaRN RoPE and its attention ``mscale`` (DeepSeek's long-context checkpoints), ``attention_bias``, ``mlp_bias``,
  activations other than SiLU.

RoPE layout: DeepSeek-V2 (and V3 with ``rope_interleave``) rotate adjacent channel pairs ``(2c, 2c + 1)``; our RoPE
rotates ``(c, c + d_r/2)``. A query-key dot product is unchanged when both sides' channels are permuted alike, so
the rows of the RoPE channels of ``q_proj``/``q_b_proj`` (per head) and ``kv_a_proj_with_mqa`` are reordered
``[0, 2, 4, ..., 1, 3, 5, ...]`` on load and back on export. V3 with ``rope_interleave=False`` already uses our
layout, but is refused (the weights carry no record of the layout, so one convention is kept: interleaved).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_llmopt.models.config import LlamaConfig
from lightning_llmopt.models.hf_rope import dtype_name, rope_from_hf, rope_to_hf
from lightning_llmopt.models.mla_config import MLAConfig

__all__ = [
    "DEEPSEEK_ARCHITECTURES",
    "deepseek_config_from_hf",
    "deepseek_config_to_hf",
    "deepseek_key_map",
    "deepseek_state_dict_from_hf",
    "deepseek_state_dict_to_hf",
]

DEEPSEEK_ARCHITECTURES: dict[str, str] = {
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
)


def _check_supported(cfg: Mapping[str, Any]) -> None:
    missing = [key for key in _REQUIRED if cfg.get(key) is None]
    if missing:
        raise ValueError(f"DeepSeek config is missing required key(s) {missing}")
    layers = int(cfg["num_hidden_layers"])
    experts = cfg.get("n_routed_experts")
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    if experts and first_dense < layers:
        raise NotImplementedError(
            f"n_routed_experts ({experts}) with first_k_dense_replace ({first_dense}) < num_hidden_layers ({layers}):"
            " DeepSeek MoE layers (dense-first layers, shared experts, routed_scaling_factor, grouped routing) do not"
            " map onto lightning_llmopt.models.moe; only configs whose every layer is dense load"
        )
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise NotImplementedError(f"{key} ({cfg[key]}) is not supported for DeepSeek models")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise NotImplementedError(f"hidden_act ({act!r}) is not supported; only 'silu' (SwiGLU) is")
    if cfg.get("model_type") == "deepseek_v3" and not cfg.get("rope_interleave", True):
        raise NotImplementedError("rope_interleave (False) is not supported; DeepSeek-V3 configs load with True")
    kv_heads = cfg.get("num_key_value_heads")
    if kv_heads is not None and int(kv_heads) != int(cfg["num_attention_heads"]):
        raise NotImplementedError(
            f"num_key_value_heads ({kv_heads}) != num_attention_heads ({cfg['num_attention_heads']}): MLA expands one"
            " key/value per query head"
        )


def deepseek_config_from_hf(cfg: dict[str, Any], **overrides: Any) -> LlamaConfig:
    """A :class:`LlamaConfig` with ``mla`` from a DeepSeek-V2/V3 ``config.json`` dict (module docstring for what is
    refused)."""
    _check_supported(cfg)
    theta, scaling = rope_from_hf({"max_position_embeddings": 2048, **cfg})
    mla = MLAConfig(
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
        qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
        v_head_dim=int(cfg["v_head_dim"]),
        q_lora_rank=None if cfg.get("q_lora_rank") is None else int(cfg["q_lora_rank"]),
    )
    n_heads = int(cfg["num_attention_heads"])
    values: dict[str, Any] = dict(
        vocab_size=int(cfg["vocab_size"]),
        dim=int(cfg["hidden_size"]),
        n_layers=int(cfg["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=n_heads,
        ffn_hidden_dim=int(cfg["intermediate_size"]),
        norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_seq_len=int(cfg.get("max_position_embeddings") or 2048),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        init_std=float(cfg.get("initializer_range", 0.02)),
        mla=mla,
        name=str(cfg.get("_name_or_path") or cfg.get("model_type")),
    )
    values.update(overrides)
    return LlamaConfig(**values)


def deepseek_config_to_hf(config: LlamaConfig, arch: str, dtype: torch.dtype) -> dict[str, Any]:
    """A DeepSeek-V2/V3 ``config.json`` dict for an MLA ``config`` (every layer dense)."""
    mla = config.mla
    if mla is None:
        raise ValueError(f"arch {arch!r} needs an MLA model (config.mla is None)")
    if config.moe is not None:
        raise NotImplementedError("exporting MoE layers as DeepSeek MoE is not supported (config.moe is set)")
    out: dict[str, Any] = {
        "architectures": [DEEPSEEK_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "intermediate_size": config.ffn_hidden_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_heads,
        "kv_lora_rank": mla.kv_lora_rank,
        "q_lora_rank": mla.q_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
        "first_k_dense_replace": config.n_layers,  # every layer dense: no MoE is instantiated
        "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        **rope_to_hf(config),
        "tie_word_embeddings": config.tie_embeddings,
        "initializer_range": config.init_std,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": dtype_name(dtype),
        "dtype": dtype_name(dtype),
    }
    if arch == "deepseek_v3":
        out["rope_interleave"] = True
    return out


_PER_LAYER: dict[str, str] = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
}
_Q_DIRECT = {"attention.wq.weight": "self_attn.q_proj.weight"}
_Q_LORA = {
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
}


def deepseek_key_map(config: LlamaConfig) -> dict[str, str]:
    """``{our name: HF name}`` for every parameter of an MLA model with ``config``."""
    assert config.mla is not None
    per_layer = {**_PER_LAYER, **(_Q_DIRECT if config.mla.q_lora_rank is None else _Q_LORA)}
    names = {
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    for i in range(config.n_layers):
        names.update({f"layers.{i}.{ours}": f"model.layers.{i}.{theirs}" for ours, theirs in per_layer.items()})
    return names


def _permute_rope_rows(name: str, w: Tensor, mla: MLAConfig, to_ours: bool) -> Tensor:
    """Reorder the RoPE rows of a query or latent projection between interleaved and rotate-half layouts."""
    dr = mla.qk_rope_head_dim
    perm = torch.cat([torch.arange(0, dr, 2), torch.arange(1, dr, 2)])
    idx = perm if to_ours else torch.argsort(perm)
    if name.endswith(("wq.weight", "wq_b.weight")):
        heads = w.view(-1, mla.qk_head_dim, w.shape[-1])  # (H, d_n + d_r, in)
        nope, rope = heads[:, : mla.qk_nope_head_dim], heads[:, mla.qk_nope_head_dim :]
        return torch.cat([nope, rope[:, idx]], 1).flatten(0, 1)
    if name.endswith("wkv_a.weight"):
        return torch.cat([w[: mla.kv_lora_rank], w[mla.kv_lora_rank :][idx]])
    return w


def _check_shapes(sd: Mapping[str, Tensor], config: LlamaConfig, names: Mapping[str, str]) -> None:
    """``ValueError`` listing every tensor whose shape differs from the model's (built on the meta device)."""
    from lightning_llmopt.models.llama import Llama

    with torch.device("meta"):
        want = {k: tuple(v.shape) for k, v in Llama(config).state_dict().items()}
    bad = [
        f"{names.get(k, k)}: {tuple(t.shape)} (expected {want[k]})" for k, t in sd.items() if tuple(t.shape) != want[k]
    ]
    if bad:
        raise ValueError(f"{len(bad)} tensor(s) have the wrong shape for the config: " + "; ".join(bad))


def deepseek_state_dict_from_hf(sd: Mapping[str, Tensor], config: LlamaConfig) -> dict[str, Tensor]:
    """Our RoPE layout for a DeepSeek state dict already given our names (new tensors only where rows move); a
    ``ValueError`` lists tensors of the wrong shape."""
    assert config.mla is not None
    _check_shapes(sd, config, deepseek_key_map(config))
    return {k: _permute_rope_rows(k, v, config.mla, to_ours=True) for k, v in sd.items()}


def deepseek_state_dict_to_hf(sd: Mapping[str, Tensor], config: LlamaConfig) -> dict[str, Tensor]:
    """Our state dict in DeepSeek's interleaved RoPE layout (names unchanged; renaming is the caller's)."""
    assert config.mla is not None
    _check_shapes(sd, config, {})
    return {k: _permute_rope_rows(k, v, config.mla, to_ours=False) for k, v in sd.items()}
