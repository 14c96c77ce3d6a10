"""Translate between :class:`LlamaConfig` and Hugging Face ``config.json`` for Llama, Mistral and Qwen2.

Reads both the transformers 4.x spelling of RoPE (top-level ``rope_theta`` plus a ``rope_scaling`` dict) and the 5.x
spelling (a ``rope_parameters`` dict holding ``rope_type`` and ``rope_theta``); writes both, so either major version
reads the result. transformers itself is never imported here: a config object is read through ``to_dict()``.

Sliding window: transformers shows query ``i`` the keys ``j`` with ``i - sliding_window < j <= i`` (its
``sliding_window_overlay``), which is :class:`LlamaConfig`'s convention, so the value carries over unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lightning_llmopt.models.config import LlamaConfig
from lightning_llmopt.models.hf_deepseek import DEEPSEEK_ARCHITECTURES, deepseek_config_from_hf, deepseek_config_to_hf
from lightning_llmopt.models.hf_patterns import check_mapped, pattern_from_hf, pattern_to_hf
from lightning_llmopt.models.hf_rope import dtype_name, rope_from_hf, rope_to_hf

ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    **DEEPSEEK_ARCHITECTURES,  # MLA models, translated by hf_deepseek
}
"""Supported ``model_type`` values and the transformers class each is exported as."""

_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# transformers' per-architecture defaults for keys an older config.json may omit.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(rms_norm_eps=1e-6, max_position_embeddings=2048),
    "mistral": dict(rms_norm_eps=1e-6, max_position_embeddings=4096 * 32, num_key_value_heads=8, sliding_window=4096),
    "qwen2": dict(
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
        num_key_value_heads=32,
        sliding_window=4096,
        use_sliding_window=False,
        max_window_layers=28,
    ),
}


def _as_dict(hf_config: Any) -> dict[str, Any]:
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    if hasattr(hf_config, "to_dict"):
        return dict(hf_config.to_dict())
    raise TypeError(f"hf_config must be a transformers PretrainedConfig or a dict, got {type(hf_config).__name__}")


def _check_supported(cfg: Mapping[str, Any], arch: str) -> None:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise NotImplementedError(f"hidden_act ({act!r}) is not supported; only 'silu' (SwiGLU) is")
    if cfg.get("mlp_bias", False):
        raise NotImplementedError("mlp_bias (True) is not supported")
    if arch != "qwen2" and cfg.get("attention_bias", False):
        raise NotImplementedError(f"attention_bias (True) on model_type {arch!r} is not supported (o_proj bias)")
    missing = [key for key in _REQUIRED if key not in cfg]
    if missing:
        raise ValueError(f"config is missing required key(s) {missing}")


def config_from_hf(hf_config: Any, **overrides: Any) -> tuple[LlamaConfig, str]:
    """Build a :class:`LlamaConfig` from a transformers config object or a ``config.json`` dict.

    Arguments:
        hf_config: a ``PretrainedConfig`` (4.51+ or 5.x) or the dict loaded from ``config.json``.
        overrides: :class:`LlamaConfig` fields to set on top (e.g. ``attn_backend="eager"``, ``max_seq_len``).

    Returns: ``(config, arch)`` with ``arch`` one of ``"llama"``, ``"mistral"``, ``"qwen2"``.

    Raises ``ValueError`` for an unknown ``model_type`` or missing keys, ``NotImplementedError`` for features the
    reference model lacks (other RoPE types, ``mlp_bias``, Llama ``attention_bias``, Gemma 2/3, Qwen3: see
    :mod:`~lightning_llmopt.models.hf_patterns`). Qwen2 ``layer_types`` mixing sliding and full attention become
    ``LlamaConfig.layer_types``.
    """
    cfg = _as_dict(hf_config)
    arch = cfg.get("model_type")
    check_mapped(arch)  # Gemma 2/3, Qwen3: say what does not map
    if arch not in ARCHITECTURES:
        raise ValueError(f"model_type ({arch!r}) is not supported; supported: {sorted(ARCHITECTURES)}")
    if arch in DEEPSEEK_ARCHITECTURES:
        return deepseek_config_from_hf(cfg, **overrides), arch
    _check_supported(cfg, arch)
    cfg = {**_DEFAULTS[arch], **{k: v for k, v in cfg.items() if v is not None or k == "sliding_window"}}
    n_heads = int(cfg["num_attention_heads"])
    theta, scaling = rope_from_hf(cfg)
    values: dict[str, Any] = dict(
        vocab_size=int(cfg["vocab_size"]),
        dim=int(cfg["hidden_size"]),
        n_layers=int(cfg["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads", n_heads)),
        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // n_heads),
        ffn_hidden_dim=int(cfg["intermediate_size"]),
        norm_eps=float(cfg["rms_norm_eps"]),
        rope_theta=theta,
        rope_scaling=scaling,
        max_seq_len=int(cfg["max_position_embeddings"]),
        **pattern_from_hf(cfg, arch, int(cfg["num_hidden_layers"]), None),  # sliding_window, layer_types
        qkv_bias=arch == "qwen2",
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        init_std=float(cfg.get("initializer_range", 0.02)),
        name=str(cfg.get("_name_or_path") or arch),
    )
    values.update(overrides)
    return LlamaConfig(**values), arch


def _check_arch(config: LlamaConfig, arch: str) -> None:
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch ({arch!r}) is not supported; supported: {sorted(ARCHITECTURES)}")
    if (arch in DEEPSEEK_ARCHITECTURES) != (config.mla is not None):
        raise ValueError(f"arch {arch!r} and mla ({config.mla}) disagree: DeepSeek architectures are the MLA models")
    if arch == "qwen2" and not config.qkv_bias:
        raise ValueError("arch 'qwen2' requires qkv_bias=True (Qwen2 always has q/k/v biases)")
    if arch != "qwen2" and config.qkv_bias:
        raise ValueError(f"arch {arch!r} has no q/k/v biases but qkv_bias is True; export as 'qwen2'")
    if arch == "llama" and config.sliding_window is not None:
        raise ValueError(
            f"arch 'llama' has no sliding window but sliding_window is {config.sliding_window}; "
            "export as 'mistral' or 'qwen2'"
        )


def arch_of(config: LlamaConfig, model_type: str | None = None) -> str:
    """The Hugging Face architecture to export ``config`` as: ``model_type`` (e.g. the source folder's) when given
    and supported, else ``"qwen2"`` for q/k/v biases, ``"mistral"`` for a sliding window, ``"llama"`` otherwise."""
    if model_type in ARCHITECTURES:
        try:
            _check_arch(config, str(model_type))
            return str(model_type)
        except ValueError:
            pass  # the model changed since (e.g. a window was added): export what it is now
    if config.mla is not None:
        return "deepseek_v2"
    if config.qkv_bias:
        return "qwen2"
    if config.layer_types is not None:  # per-layer windows: all local exports as Mistral, a mix only as Qwen2
        return "mistral" if all(t != "global" for t in config.layer_types) else "qwen2"
    return "mistral" if config.sliding_window is not None else "llama"


def config_to_hf(config: LlamaConfig, arch: str = "llama", dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """A ``config.json`` dict that transformers (4.51+ and 5.x) reads as the same model.

    Arguments:
        config: the model's :class:`LlamaConfig`.
        arch: ``"llama"``, ``"mistral"`` or ``"qwen2"``; checked against ``qkv_bias`` and ``sliding_window``.
        dtype: recorded as ``torch_dtype`` (4.x) and ``dtype`` (5.x): the dtype of the saved weights.
    """
    _check_arch(config, arch)
    if arch in DEEPSEEK_ARCHITECTURES:
        return deepseek_config_to_hf(config, arch, dtype)
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "intermediate_size": config.ffn_hidden_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        **rope_to_hf(config),
        "tie_word_embeddings": config.tie_embeddings,
        "initializer_range": config.init_std,
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": dtype_name(dtype),
        "dtype": dtype_name(dtype),
    }
    if arch == "llama":
        out.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    elif arch == "mistral":
        out["sliding_window"] = config.sliding_window
    else:
        sliding = config.sliding_window is not None
        out.update(
            use_sliding_window=sliding,
            sliding_window=config.sliding_window,
            max_window_layers=0 if sliding else config.n_layers,
            layer_types=["sliding_attention" if sliding else "full_attention"] * config.n_layers,
        )
    out.update(pattern_to_hf(config, arch) or {})  # per-layer windows (Qwen2); refuses cross-layer KV sharing
    return out
