"""Per-layer attention patterns: interleaved local (sliding-window) / global layers and cross-layer KV sharing.

Two :class:`~lightning_llmopt.models.config.LlamaConfig` fields describe them:

- ``layer_types``: one entry per layer, ``"global"`` (full causal attention), ``"local"`` (a sliding window of
  ``sliding_window`` keys) or ``"local:<w>"`` (its own window of ``w`` keys). Gemma 3 style is
  ``["local"] * 5 + ["global"]`` repeated; Gemma 2 style alternates. Without ``layer_types`` every layer uses
  ``sliding_window`` (``None``: all global), as before.
- ``kv_sources``: one entry per layer, the index of the layer whose keys/values it attends over (cross-layer
  attention, CLA: Brandon et al., arXiv 2405.12981). ``kv_sources[i] == i`` marks a layer that produces K/V; a
  layer with ``kv_sources[i] = j < i`` has no ``wk``/``wv`` and reads layer ``j``'s (already rotated) keys and
  values. A source must produce K/V itself and have the same window as every layer reading it, so one cache per
  producer serves them all. :func:`cla_kv_sources` builds the CLA-``f`` pattern (groups of ``f`` adjacent layers
  share the K/V of the lowest).

The window convention is the model's: a query sees itself and the ``w - 1`` keys before it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = [
    "LAYER_KINDS",
    "SharedKV",
    "attended_keys",
    "cla_kv_sources",
    "kv_producers",
    "layer_kinds",
    "layer_windows",
    "normalize_layer_pattern",
    "pattern_layers",
]

LAYER_KINDS = ("global", "local")


def pattern_layers(pattern: list[str], n_layers: int) -> list[str]:
    """``pattern`` repeated (and cut) to ``n_layers`` entries: ``pattern_layers(["local"] * 5 + ["global"], 12)``."""
    if not pattern:
        raise ValueError("pattern must name at least one layer kind")
    return [pattern[i % len(pattern)] for i in range(n_layers)]


def cla_kv_sources(n_layers: int, factor: int) -> list[int]:
    """CLA-``factor`` sources: layer ``i`` reads the K/V of layer ``factor * (i // factor)``."""
    if factor < 1:
        raise ValueError(f"factor ({factor}) must be >= 1")
    return [factor * (i // factor) for i in range(n_layers)]


def _parse_kind(entry: Any, index: int, default_window: int | None) -> int | None:
    """The window of one ``layer_types`` entry (``None``: global)."""
    if not isinstance(entry, str):
        raise ValueError(f"layer_types[{index}] ({entry!r}) must be 'global', 'local' or 'local:<window>'")
    kind, _, size = entry.partition(":")
    if kind == "global" and not size:
        return None
    if kind != "local":
        raise ValueError(f"layer_types[{index}] ({entry!r}) must be 'global', 'local' or 'local:<window>'")
    if size:
        if not size.isdigit() or int(size) <= 0:
            raise ValueError(f"layer_types[{index}] ({entry!r}): the window must be a positive integer")
        return int(size)
    if default_window is None:
        raise ValueError(f"layer_types[{index}] is 'local' but sliding_window is None: set it or write 'local:<w>'")
    return default_window


def normalize_layer_pattern(config: Any) -> None:
    """Check ``config.layer_types`` and ``config.kv_sources`` (raising ``ValueError`` naming the bad value) and
    store them as plain lists; called from ``LlamaConfig.__post_init__``."""
    n = config.n_layers
    if config.layer_types is not None:
        types = [config.layer_types] if isinstance(config.layer_types, str) else list(config.layer_types)
        if len(types) != n:
            raise ValueError(f"layer_types has {len(types)} entries but n_layers is {n}")
        for i, entry in enumerate(types):
            _parse_kind(entry, i, config.sliding_window)
        config.layer_types = types
    if config.kv_sources is not None:
        sources = [int(s) for s in config.kv_sources]
        if len(sources) != n:
            raise ValueError(f"kv_sources has {len(sources)} entries but n_layers is {n}")
        windows = layer_windows(config)
        for i, s in enumerate(sources):
            if not 0 <= s <= i:
                raise ValueError(f"kv_sources[{i}] ({s}) must name this layer or one below it (0..{i})")
            if sources[s] != s:
                raise ValueError(f"kv_sources[{i}] ({s}) names layer {s}, which reads layer {sources[s]}'s K/V itself")
            if windows[s] != windows[i]:
                raise ValueError(
                    f"layer {i} (window {windows[i]}) reads the K/V of layer {s} (window {windows[s]}): a layer "
                    "and its K/V source must have the same window"
                )
        config.kv_sources = sources


def layer_windows(config: Any) -> list[int | None]:
    """Window of every layer (``None``: global attention)."""
    if config.layer_types is None:
        return [config.sliding_window] * config.n_layers
    return [_parse_kind(t, i, config.sliding_window) for i, t in enumerate(config.layer_types)]


def layer_kinds(config: Any) -> list[str]:
    """``"global"`` or ``"local"`` for every layer."""
    return ["global" if w is None else "local" for w in layer_windows(config)]


def attended_keys(seq_len: int, window: int | None) -> float:
    """Mean keys per query of a causal (optionally windowed) mask over ``seq_len`` tokens, in PaLM's convention
    (arXiv 2204.02311 appendix B): ``seq_len / 2`` without a window, the exact mean ``(seq_len + 1) / 2`` less half a
    key; a window ``w < seq_len`` likewise, ``(w (w + 1) / 2 + (seq_len - w) w) / seq_len - 1/2``. FLOP counts
    (``Llama.flops_per_token``, the pipeline cost model) charge every layer its own."""
    if window is None or window >= seq_len:
        return seq_len / 2
    return (window * (window + 1) / 2 + (seq_len - window) * window) / seq_len - 0.5


def kv_producers(config: Any) -> list[int]:
    """Layers that compute (and cache) keys/values, in order."""
    if config.kv_sources is None:
        return list(range(config.n_layers))
    return [i for i, s in enumerate(config.kv_sources) if s == i]


class SharedKV:
    """The :class:`~lightning_llmopt.models.kv_cache.KVCache` the model passes its blocks when layers share K/V:
    producers store what they attend over, readers get it back with :meth:`shared`.

    Arguments:
        inner: the caller's cache (``None`` in training: the layer's own keys and values are what it attends
            over, with ``None`` key positions so the layer keeps its training mask).
    """

    def __init__(self, inner: Any = None) -> None:
        self.inner = inner
        self.kv: dict[int, tuple[Tensor, Tensor, Tensor | None]] = {}

    def update(self, layer_id: int, k: Tensor, v: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Any]:
        out = self.inner.update(layer_id, k, v, positions) if self.inner is not None else (k, v, None)
        self.kv[layer_id] = out
        return out

    def shared(self, layer_id: int) -> tuple[Tensor, Tensor, Tensor | None]:
        """What layer ``layer_id`` stored this forward pass: ``(k, v, k_positions or None)``."""
        if layer_id not in self.kv:
            raise RuntimeError(
                f"layer {layer_id}'s keys/values are needed but it did not run in this forward pass (a pipeline "
                "stage or a split that separates a layer from its K/V source is not supported)"
            )
        return self.kv[layer_id]


def kv_cache_bytes(config: Any, context: int, batch: int = 1, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of keys and values a contiguous cache holds for ``batch`` sequences of ``context`` tokens: producers
    only, a local producer at most its window."""
    size = torch.empty((), dtype=dtype).element_size()
    windows = layer_windows(config)
    per_token = 2 * config.n_kv_heads * config.head_dim * size
    total = 0
    for i in kv_producers(config):
        w = windows[i]
        total += per_token * batch * (context if w is None else min(context, w))
    return total


def kv_window(config: Any) -> int | None:
    """The widest window any layer needs (``None`` when a layer is global): keys older than it are read by no
    layer, so a cache may drop them."""
    windows = layer_windows(config)
    return None if any(w is None for w in windows) else max(w for w in windows if w is not None)
