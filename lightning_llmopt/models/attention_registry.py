"""The attention backend registry, the mask description every backend takes, and the two PyTorch backends.

Every backend computes ``softmax(q k^T * scale + mask) v`` for

- ``q``: ``(B, H, T, D)``; ``k``, ``v``: ``(B, H_kv, S, D)`` with ``H % H_kv == 0`` (GQA/MQA: query head ``h`` reads
  key/value head ``h // (H // H_kv)``);
- a :class:`AttentionMask` saying which keys each query may see.

The mask rule, for query ``i`` and key ``j`` of the same batch row:

    visible(i, j) = k_pos[j] >= 0                       (slot holds a key; -1 marks empty cache slots)
                and k_pos[j] <= q_pos[i]                (causal)
                and q_pos[i] - k_pos[j] < window        (sliding window of ``window`` keys, itself included)
                and q_doc[i] == k_doc[j]                (packed documents never see each other)

Positions are per document when documents are packed (they restart at 0), so ``doc_ids`` must be passed with them.
Backends are looked up by name (:func:`get_backend`); ``"sdpa"`` and ``"eager"`` are defined here, kernels from
later modules (:mod:`~lightning_llmopt.models.attention_flex`, :mod:`~lightning_llmopt.models.attention_triton`)
register themselves with :func:`register_backend`. Call through :func:`lightning_llmopt.models.attention.attention`,
which imports those modules, so every backend is registered.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

AttentionFn = Callable[[Tensor, Tensor, Tensor, "AttentionMask", float], Tensor]


@dataclass
class AttentionMask:
    """Which keys each query sees (see the module docstring for the rule).

    Arguments:
        q_positions: ``(B, T)`` int64 positions of the queries.
        k_positions: ``(B, S)`` int64 positions of the keys, -1 for empty slots.
        q_doc_ids: optional ``(B, T)`` document index of each query.
        k_doc_ids: optional ``(B, S)`` document index of each key.
        window: optional sliding-window size in keys (the query's own key included).
        plain_causal: True when positions are ``arange(T)`` for queries and keys alike, with no documents, no
            window and no cache, so backends may take their ``is_causal`` fast path.
    """

    q_positions: Tensor
    k_positions: Tensor
    q_doc_ids: Tensor | None = None
    k_doc_ids: Tensor | None = None
    window: int | None = None
    plain_causal: bool = False

    def dense(self) -> Tensor:
        """Boolean ``(B, 1, T, S)`` mask, True where attention is allowed."""
        qp = self.q_positions[:, :, None]
        kp = self.k_positions[:, None, :]
        allowed = (kp >= 0) & (kp <= qp)
        if self.window is not None:
            allowed &= (qp - kp) < self.window
        if self.q_doc_ids is not None:
            k_docs = self.k_doc_ids if self.k_doc_ids is not None else self.q_doc_ids
            allowed &= self.q_doc_ids[:, :, None] == k_docs[:, None, :]
        return allowed[:, None]

    @staticmethod
    def causal(batch: int, seq_len: int, device: torch.device, window: int | None = None) -> AttentionMask:
        pos = torch.arange(seq_len, device=device).expand(batch, seq_len)
        return AttentionMask(pos, pos, window=window, plain_causal=window is None)


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, scale: float) -> Tensor:
    gqa = q.shape[1] != k.shape[1]
    if mask.plain_causal and q.shape[2] == k.shape[2]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    dense = mask.dense()
    # A query with no visible key (only possible with empty cache slots) would produce NaN: let it see nothing
    # but return zeros instead.
    empty = ~dense.any(dim=-1, keepdim=True)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=dense | empty, scale=scale, enable_gqa=gqa)
    return out.masked_fill(empty, 0.0)  # unconditionally: testing empty.any() would wait for the device per layer


def _eager(q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, scale: float) -> Tensor:
    """Explicit softmax attention with fp32 scores: the numerical reference for every other backend."""
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)  # (B, H, S, D)
    v = v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # (B, H, T, S)
    dense = mask.dense()
    scores = scores.masked_fill(~dense, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # rows with no visible key
    return torch.matmul(probs, v.float()).to(q.dtype)


_BACKENDS: dict[str, AttentionFn] = {"sdpa": _sdpa, "eager": _eager}


def register_backend(name: str, fn: AttentionFn, *, overwrite: bool = False) -> None:
    """Register an attention implementation under ``name`` (for ``LlamaConfig.attn_backend``)."""
    if name in _BACKENDS and not overwrite:
        raise ValueError(f"attention backend {name!r} is already registered")
    _BACKENDS[name] = fn


def registered_backends() -> tuple[str, ...]:
    return tuple(_BACKENDS)


def get_backend(name: str) -> AttentionFn:
    if name not in _BACKENDS:
        raise ValueError(f"attn_backend ({name!r}) must be one of {sorted(_BACKENDS)}")
    return _BACKENDS[name]


def doc_ids_from_cu_seqlens(cu_seqlens: Tensor, total: int) -> Tensor:
    """Document index of every token of a packed row.

    Arguments:
        cu_seqlens: ``(N + 1,)`` int cumulative lengths starting at 0, as flash-attention's varlen API takes them.
        total: number of tokens in the row (``cu_seqlens[-1]`` must not exceed it; tokens past it form a last
            padding document).

    Returns: ``(total,)`` int64.
    """
    if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2 or int(cu_seqlens[0]) != 0:
        raise ValueError("cu_seqlens must be a 1-D tensor starting with 0 and holding at least one length")
    if int(cu_seqlens[-1]) > total:
        raise ValueError(f"cu_seqlens[-1] ({int(cu_seqlens[-1])}) exceeds the row length ({total})")
    idx = torch.arange(total, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].to(idx.dtype), idx, right=True)


def positions_from_doc_ids(doc_ids: Tensor) -> Tensor:
    """Per-document positions (restarting at 0 at every document start) of ``(B, T)`` sorted doc ids."""
    B, T = doc_ids.shape
    idx = torch.arange(T, device=doc_ids.device).expand(B, T)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    start_idx = torch.where(starts, idx, torch.zeros_like(idx))
    return idx - torch.cummax(start_idx, dim=1).values


__all__ = [
    "AttentionFn",
    "AttentionMask",
    "doc_ids_from_cu_seqlens",
    "get_backend",
    "positions_from_doc_ids",
    "register_backend",
    "registered_backends",
]
