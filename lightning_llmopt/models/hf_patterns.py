"""Layer patterns across Hugging Face interop: which transformers configs map onto our per-layer windows, and which
do not (and why).

What maps (transformers 5.x spelling; 4.x ``max_window_layers`` read too):

- Mistral ``sliding_window``: every layer local with that window (``LlamaConfig.sliding_window``).
- Qwen2 ``layer_types`` mixing ``"sliding_attention"`` and ``"full_attention"`` with ``use_sliding_window``: the
  same layers ``"local"`` / ``"global"`` with ``sliding_window`` as the local window. transformers' Qwen2 drops the
  window entirely when ``use_sliding_window`` is false, and so do we.

What does not, refused by name with the reason (:data:`UNMAPPED`): Gemma 2 and Gemma 3 (their local/global
patterns come with norms, embedding scaling, soft-capping and activations our decoder does not have), Qwen3 (per-head
q/k norms). Exporting: per-layer windows go out as Qwen2 (so the model needs ``qkv_bias``, as Qwen2 always has),
with one window shared by every local layer; cross-layer KV sharing has no transformers architecture to go to.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["UNMAPPED", "check_mapped", "pattern_from_hf", "pattern_to_hf"]

UNMAPPED: dict[str, str] = {
    "gemma2": (
        "Gemma 2 does not map onto the Llama-family decoder: it scales embeddings by sqrt(hidden_size), uses RMSNorm "
        "with (1 + weight), adds post-attention and post-feed-forward norms, soft-caps attention and final logits, "
        "scales queries by query_pre_attn_scalar and uses a GeGLU (gelu_pytorch_tanh) MLP"
    ),
    "gemma3_text": (
        "Gemma 3 does not map onto the Llama-family decoder: besides Gemma 2's differences (embedding scaling, "
        "(1 + weight) RMSNorm, post-attention/post-feed-forward norms, query_pre_attn_scalar, GeGLU) it has "
        "per-head q/k norms and a separate RoPE base for its local layers (rope_local_base_freq)"
    ),
    "qwen3": (
        "Qwen3 does not map onto the Llama-family decoder: it applies a per-head RMSNorm to queries and keys "
        "(q_norm, k_norm) before RoPE"
    ),
}
UNMAPPED["gemma3"] = UNMAPPED["gemma3_text"]
UNMAPPED["gemma"] = (
    "Gemma does not map onto the Llama-family decoder: it scales embeddings by sqrt(hidden_size), uses RMSNorm "
    "with (1 + weight) and a GeGLU (gelu_pytorch_tanh) MLP"
)


def check_mapped(model_type: Any) -> None:
    """Raise ``NotImplementedError`` saying what does not map, for architectures known not to map."""
    if model_type in UNMAPPED:
        raise NotImplementedError(f"model_type {model_type!r} is not supported: {UNMAPPED[model_type]}")


def pattern_from_hf(cfg: Mapping[str, Any], arch: str, n_layers: int, default_window: int | None) -> dict[str, Any]:
    """``LlamaConfig`` fields (``sliding_window``, ``layer_types``) for the attention pattern of ``cfg``."""
    if arch == "llama":
        return dict(sliding_window=None)  # transformers' Llama ignores any sliding_window key
    window = cfg.get("sliding_window", default_window)
    if arch == "mistral" or window is None:
        return dict(sliding_window=None if window is None else int(window))
    if not cfg.get("use_sliding_window", False):  # qwen2: transformers then sets sliding_window to None
        return dict(sliding_window=None)
    types = cfg.get("layer_types")
    if types is None:  # 4.x: the window applies to layers >= max_window_layers
        first = int(cfg.get("max_window_layers", n_layers))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
    bad = sorted({t for t in types if t not in ("sliding_attention", "full_attention")})
    if bad:
        raise NotImplementedError(f"layer_types entries {bad} are not supported (sliding_attention/full_attention)")
    if len(types) != n_layers:
        raise ValueError(f"layer_types has {len(types)} entries but num_hidden_layers is {n_layers}")
    if all(t == "sliding_attention" for t in types):
        return dict(sliding_window=int(window))
    if not any(t == "sliding_attention" for t in types):
        return dict(sliding_window=None)
    return dict(
        sliding_window=int(window),
        layer_types=["local" if t == "sliding_attention" else "global" for t in types],
    )


def pattern_to_hf(config: Any, arch: str) -> dict[str, Any] | None:
    """The Qwen2 ``config.json`` keys of a per-layer pattern (``None`` without ``layer_types``); raises
    ``ValueError`` for what no exported architecture expresses."""
    if config.kv_sources is not None and any(s != i for i, s in enumerate(config.kv_sources)):
        raise ValueError(
            f"kv_sources ({config.kv_sources}): cross-layer KV sharing has no transformers architecture to export to"
        )
    if config.layer_types is None:
        return None
    from lightning_llmopt.models.layer_pattern import layer_windows

    windows = layer_windows(config)
    local = sorted({w for w in windows if w is not None})
    if not local:
        return dict(use_sliding_window=False, sliding_window=None, layer_types=["full_attention"] * len(windows))
    if len(local) > 1:
        raise ValueError(f"local layers with different windows ({local}) do not map onto one HF sliding_window")
    if all(w is not None for w in windows) and arch == "mistral":
        return dict(sliding_window=local[0])
    if arch != "qwen2":
        raise ValueError(
            f"layer_types mixing local and global layers export only as 'qwen2' (q/k/v biases), not {arch!r}"
        )
    return dict(
        use_sliding_window=True,
        sliding_window=local[0],
        max_window_layers=0,
        layer_types=["full_attention" if w is None else "sliding_attention" for w in windows],
    )
