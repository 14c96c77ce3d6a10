"""The ``"flex"`` attention backend: ``torch.nn.attention.flex_attention`` with a block mask built from the
:class:`~lightning_llmopt.models.attention.AttentionMask` (documents, causal by position, sliding window, empty cache
slots), GQA through ``enable_gqa=True``.

Importing this module only registers the backend; ``flex_attention`` is imported on the first call. On CUDA the
kernel is ``torch.compile(flex_attention)``, compiled once per process and cached. On CPU, where flex runs unfused
and has no backward, the forward without gradients uses eager flex; with gradients (or where flex is unavailable) the
call falls back to the SDPA dense-mask path. This is the GPU path for packed batches until a varlen kernel exists.

The block mask is built once per :class:`AttentionMask` instance and device (all layers of a forward pass share it).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
from torch import Tensor

from lightning_llmopt.models.attention_registry import AttentionMask, _sdpa, register_backend, registered_backends

_CACHE_ATTR = "_flex_block_mask"


@functools.cache
def _flex_module() -> Any:
    """``torch.nn.attention.flex_attention``, or None when this torch build lacks it."""
    try:
        from torch.nn.attention import flex_attention as module
    except ImportError:  # pragma: no cover - every supported torch has it
        return None
    return module


@functools.cache
def _compiled_flex() -> Any:
    return torch.compile(_flex_module().flex_attention, dynamic=False)


def flex_available(device: torch.device, needs_grad: bool) -> bool:
    """Whether flex attention runs for inputs on ``device`` (CPU: forward only)."""
    if _flex_module() is None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and not needs_grad)


def _mask_mod(mask: AttentionMask) -> Any:
    """``mask_mod(b, h, q_idx, kv_idx) -> bool`` implementing the rule of :mod:`lightning_llmopt.models.attention`."""
    q_pos, k_pos, window = mask.q_positions, mask.k_positions, mask.window
    q_doc = mask.q_doc_ids
    k_doc = mask.k_doc_ids if mask.k_doc_ids is not None else mask.q_doc_ids

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        qp, kp = q_pos[b, q_idx], k_pos[b, kv_idx]
        allowed = (kp >= 0) & (kp <= qp)
        if window is not None:
            allowed = allowed & (qp - kp < window)
        if q_doc is not None and k_doc is not None:
            allowed = allowed & (q_doc[b, q_idx] == k_doc[b, kv_idx])
        return allowed

    return mask_mod


def _causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return kv_idx <= q_idx


@functools.lru_cache(maxsize=8)
def _causal_block_mask(q_len: int, kv_len: int, device: torch.device) -> Any:
    return _flex_module().create_block_mask(_causal, None, None, q_len, kv_len, device=device)


def block_mask(mask: AttentionMask, q_len: int, kv_len: int, device: torch.device) -> Any:
    """The flex ``BlockMask`` of ``mask`` for ``q_len`` queries and ``kv_len`` keys, cached on the mask instance."""
    if mask.plain_causal and q_len == kv_len:
        return _causal_block_mask(q_len, kv_len, device)
    key = (q_len, kv_len, str(device))
    cached = getattr(mask, _CACHE_ATTR, None)
    if cached is not None and cached[0] == key:
        return cached[1]
    batch = mask.q_positions.shape[0]
    built = _flex_module().create_block_mask(_mask_mod(mask), batch, None, q_len, kv_len, device=device)
    if not torch.compiler.is_compiling():
        object.__setattr__(mask, _CACHE_ATTR, (key, built))
    return built


def flex(q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, scale: float) -> Tensor:
    """Flex attention; shapes as every backend: q ``(B, H, T, D)``, k/v ``(B, H_kv, S, D)`` -> ``(B, H, T, D)``.

    A query that sees no key (only empty cache slots) returns zeros, as in the other backends.
    """
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if not flex_available(q.device, needs_grad):
        return _sdpa(q, k, v, mask, scale)
    bm = block_mask(mask, q.shape[2], k.shape[2], q.device)
    gqa = q.shape[1] != k.shape[1]
    if q.device.type == "cuda":
        return _compiled_flex()(q, k, v, block_mask=bm, scale=scale, enable_gqa=gqa)
    with warnings.catch_warnings():  # unfused on CPU by design: this path is the reference, not the fast one
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        return _flex_module().flex_attention(q, k, v, block_mask=bm, scale=scale, enable_gqa=gqa)


if "flex" not in registered_backends():
    register_backend("flex", flex)
