"""RoPE and dtype keys of a Hugging Face ``config.json``, shared by :mod:`~lightning_llmopt.models.hf_config` and
:mod:`~lightning_llmopt.models.hf_deepseek`.

Reads both the transformers 4.x spelling of RoPE (top-level ``rope_theta`` plus a ``rope_scaling`` dict) and the 5.x
spelling (a ``rope_parameters`` dict holding ``rope_type`` and ``rope_theta``); writes both.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lightning_llmopt.models.config import LlamaConfig, RopeScaling

__all__ = ["dtype_name", "rope_from_hf", "rope_to_hf"]

_UNSCALED_ROPE = (None, "default")


def rope_from_hf(cfg: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, rope_scaling)`` from either the 4.x or the 5.x spelling."""
    params = cfg.get("rope_parameters")
    if params is None:
        params = dict(cfg.get("rope_scaling") or {})
    else:
        params = dict(params)
        layer_types = set(cfg.get("layer_types") or ())
        nested = [key for key in params if key in layer_types]
        if nested:  # 5.x per-layer-type RoPE: accept it only when every layer type uses the same one
            distinct = {repr(sorted(params[key].items())) for key in nested if params[key] is not None}
            if len(distinct) != 1:
                raise NotImplementedError(f"different RoPE per layer type is not supported: {params}")
            params = dict(params[nested[0]])
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type"))
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if partial is not None and float(partial) != 1.0:
        raise NotImplementedError(f"partial_rotary_factor ({partial}) is not supported; only 1.0 is")
    if rope_type in _UNSCALED_ROPE:
        return theta, None
    needs = {"linear": ["factor"], "llama3": ["factor", "low_freq_factor", "high_freq_factor"]}.get(str(rope_type))
    if needs is None:
        raise NotImplementedError(f"rope type {rope_type!r} is not supported; supported: default, linear, llama3")
    missing = [key for key in needs if key not in params]
    if missing:
        raise ValueError(f"rope type {rope_type!r} needs key(s) {missing}; got {params}")
    if rope_type == "linear":
        return theta, RopeScaling(type="linear", factor=float(params["factor"]))
    original = params.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 8192))
    return theta, RopeScaling(
        type="llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(original),
    )


def rope_to_hf(config: LlamaConfig) -> dict[str, Any]:
    """The RoPE keys of a config.json, in the 4.x (``rope_theta``, ``rope_scaling``) and 5.x spellings at once."""
    scaling = config.rope_scaling
    if scaling is None:
        legacy: dict[str, Any] | None = None
        params: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    elif scaling.type == "linear":
        legacy = {"rope_type": "linear", "factor": scaling.factor}
        params = {**legacy, "rope_theta": config.rope_theta}
    else:
        legacy = {
            "rope_type": "llama3",
            "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
        }
        params = {**legacy, "rope_theta": config.rope_theta}
    return {"rope_theta": config.rope_theta, "rope_scaling": legacy, "rope_parameters": params}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
