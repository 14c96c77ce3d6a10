"""Pure-PyTorch reference of :func:`lightning_llmopt.kernels.paged_attention`: the CPU path and the test oracle.

Layout (the engine's KV pool, one layer):

- ``q``: ``(B, H, D)``, one query per sequence (decode);
- ``k_cache``/``v_cache``: ``(num_blocks, H_kv, block_size, D)``; slot ``(block, s)`` holds one token of every head;
- ``block_tables``: ``(B, max_blocks)`` int, the physical block of each logical block of a sequence (unused entries
  may hold anything, 0 by convention);
- ``context_lens``: ``(B,)`` int, the number of tokens of the sequence, the query's own included: the query sits at
  position ``context_lens[b] - 1`` and its key is already in the cache.

Mask rule: key position ``j`` is visible to row ``b`` iff ``j < ctx`` and, with a window, ``j >= ctx - window``
(``window`` keys, the query's own included: the convention of
:class:`~lightning_llmopt.models.attention.AttentionMask`). A row with ``ctx == 0`` (padding) returns zeros.

int8 caches hold ``round(x / scale)``; ``k_scale``/``v_scale`` ``(H_kv,)`` fp32 are the per-head scales.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["gather_pages", "paged_attention_ref"]


def gather_pages(
    cache: Tensor, block_tables: Tensor, scale: Tensor | None = None, dtype: torch.dtype | None = None
) -> Tensor:
    """Contiguous ``(B, H_kv, max_blocks * block_size, D)`` view of the pages of every row (a copy).

    ``scale`` ``(H_kv,)`` dequantizes an int8 cache; ``dtype`` is the result's dtype (default: the cache's, or fp32
    for int8).
    """
    B, n = block_tables.shape
    _, H_kv, page, D = cache.shape
    pages = cache[block_tables.long().clamp(min=0)]  # (B, n, H_kv, page, D)
    out = pages.permute(0, 2, 1, 3, 4).reshape(B, H_kv, n * page, D)  # (B, H_kv, S, D)
    if scale is not None:
        out = out.float() * scale.float().view(1, H_kv, 1, 1)
    target = dtype or (torch.float32 if cache.dtype == torch.int8 else cache.dtype)
    return out.to(target)


def paged_attention_ref(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    *,
    softmax_scale: float | None = None,
    window: int | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    upcast: bool = True,
) -> Tensor:
    """Decode attention over paged keys/values (layout and mask in the module docstring); returns ``(B, H, D)``.

    Arguments:
        upcast: compute in fp32 (fp64 inputs stay fp64); ``False`` computes in ``q``'s dtype, "plain PyTorch in the
            same dtype" for derived test tolerances.
    """
    B, H, D = q.shape
    H_kv = k_cache.shape[1]
    if H % H_kv:
        raise ValueError(f"query heads ({H}) must be a multiple of key/value heads ({H_kv})")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    compute = torch.promote_types(q.dtype, torch.float32) if upcast else q.dtype
    k = gather_pages(k_cache, block_tables, k_scale, compute)  # (B, H_kv, S, D)
    v = gather_pages(v_cache, block_tables, v_scale, compute)
    S = k.shape[2]
    pos = torch.arange(S, device=q.device)[None, :]
    ctx = context_lens.to(q.device).long()[:, None]
    visible = pos < ctx  # (B, S)
    if window is not None:
        visible &= pos >= ctx - window
    rep = H // H_kv
    k = k.repeat_interleave(rep, dim=1)  # (B, H, S, D)
    v = v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("bhd,bhsd->bhs", q.to(compute), k) * scale  # (B, H, S)
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows without keys (padding) give 0
    return torch.einsum("bhs,bhsd->bhd", probs, v).to(q.dtype)
