"""Calibration of the int8 KV cache's per-head scales.

FP8/int8 KV caches need calibrated scales: unit scales have been shown to destroy accuracy, so the engine never
uses a default. The scale of a (layer, key/value head) is ``margin * max|x| / 127`` over the keys (rotated, as they
are cached) or values that head produced on calibration prompts; values beyond the calibrated range are clamped.

The statistics are gathered through the models' KV-cache seam: :class:`ObservingKVCache` implements
:class:`~lightning_llmopt.models.kv_cache.KVCache`, records absolute maxima in ``update`` and returns the new keys
and values unchanged, so an ordinary forward pass of the reference model computes them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_llmopt.inference.kv_pool import KVScales
from lightning_llmopt.models.layer_pattern import kv_producers

__all__ = ["ObservingKVCache", "calibrate_kv_scales"]


class ObservingKVCache:
    """A pass-through :class:`~lightning_llmopt.models.kv_cache.KVCache` recording per-head ``max|k|``, ``max|v|``."""

    def __init__(self, n_layers: int, n_kv_heads: int) -> None:
        self.k_absmax = torch.zeros(n_layers, n_kv_heads)
        self.v_absmax = torch.zeros(n_layers, n_kv_heads)
        self.tokens = 0

    def update(self, layer_id: int, k: Tensor, v: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        # k, v: (B, H_kv, T, D)
        self.k_absmax[layer_id] = torch.maximum(self.k_absmax[layer_id], k.detach().abs().amax(dim=(0, 2, 3)).cpu())
        self.v_absmax[layer_id] = torch.maximum(self.v_absmax[layer_id], v.detach().abs().amax(dim=(0, 2, 3)).cpu())
        if layer_id == 0:
            self.tokens += positions.numel()
        return k, v, positions


@torch.no_grad()
def calibrate_kv_scales(model: nn.Module, prompts: Iterable[Sequence[int]], margin: float = 1.0) -> KVScales:
    """Per-(layer, head) int8 scales from the keys/values the model produces on ``prompts`` (lists of token ids).

    With cross-layer KV sharing (``kv_sources``) only producing layers are cached: the scales then have one row per
    producer (in layer order, the engine pool's layout), readers having no keys/values of their own.

    Raises ``ValueError`` when no prompt is given or a head never produced a non-zero value (its scale would be
    undefined; no unit-scale fallback).
    """
    if margin <= 0:
        raise ValueError(f"margin ({margin}) must be > 0")
    cfg: Any = model.config
    obs = ObservingKVCache(cfg.n_layers, cfg.n_kv_heads)
    device = next(model.parameters()).device
    count = 0
    for prompt in prompts:
        ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)
        if ids.numel() == 0:
            continue
        pos = torch.arange(ids.shape[1], device=device)[None]
        model(ids, positions=pos, kv_cache=obs)
        count += 1
    if count == 0:
        raise ValueError("calibrate_kv_scales needs at least one non-empty prompt")
    producers = kv_producers(cfg) if getattr(cfg, "kv_sources", None) is not None else list(range(cfg.n_layers))
    obs.k_absmax, obs.v_absmax = obs.k_absmax[producers], obs.v_absmax[producers]
    for name, amax in (("key", obs.k_absmax), ("value", obs.v_absmax)):
        zero = (amax <= 0).nonzero()
        if len(zero):
            layer, head = producers[int(zero[0][0])], int(zero[0][1])
            raise ValueError(
                f"calibration saw only zero {name}s for layer {layer}, head {head}: no scale can be "
                "derived (use more varied prompts)"
            )
    return KVScales(obs.k_absmax * margin / 127.0, obs.v_absmax * margin / 127.0)
