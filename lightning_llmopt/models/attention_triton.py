"""The ``"triton"`` attention backend: :func:`lightning_llmopt.kernels.flash_attention` behind the backend interface.

The :class:`~lightning_llmopt.models.attention.AttentionMask` is mapped to the kernel's arguments:

- ``plain_causal`` with as many keys as queries: ``causal=True`` on ``(B, S, H, D)`` views of the model's
  ``(B, H, S, D)`` tensors (no copy);
- self-attention whose positions are ``arange`` per row (``window`` allowed): the same, with ``window``;
- packed rows (``doc_ids`` with positions restarting at 0 in each document, documents contiguous): every row's
  documents become entries of one ``cu_seqlens`` over the ``B*T`` flattened tokens (``causal=True``, ``window``);
- anything else (a KV cache with empty slots or other positions, arbitrary positions): the SDPA dense-mask path.

The mapping is computed once per mask instance and device (one host sync), then reused by every layer. Importing
this module registers the backend and imports no Triton; the kernel path needs CUDA (or ``TRITON_INTERPRET=1`` on
CPU, for tests), and elsewhere the backend falls back to the SDPA path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_llmopt.models.attention_registry import (
    AttentionMask,
    _sdpa,
    positions_from_doc_ids,
    register_backend,
    registered_backends,
)

_CACHE_ATTR = "_triton_attention_plan"


@dataclass(frozen=True)
class _Plan:
    kind: str  # "dense" | "varlen" | "fallback"
    cu_seqlens: Tensor | None = None
    max_seqlen: int = 0


def _build_plan(mask: AttentionMask, q_len: int, kv_len: int) -> _Plan:
    if mask.plain_causal and q_len == kv_len:
        return _Plan("dense")
    if q_len != kv_len:
        return _Plan("fallback")
    k_docs = mask.k_doc_ids
    if k_docs is not None and k_docs is not mask.q_doc_ids:
        if mask.q_doc_ids is None or not torch.equal(k_docs, mask.q_doc_ids):
            return _Plan("fallback")
    q_pos, k_pos = mask.q_positions, mask.k_positions
    if q_pos is not k_pos and not torch.equal(q_pos, k_pos):
        return _Plan("fallback")  # a KV cache, or keys at other positions
    B, T = q_pos.shape
    if mask.q_doc_ids is None:
        if torch.equal(q_pos, torch.arange(T, device=q_pos.device).expand(B, T)):
            return _Plan("dense")
        return _Plan("fallback")
    docs = mask.q_doc_ids
    if T > 1 and bool((docs[:, 1:] < docs[:, :-1]).any()):
        return _Plan("fallback")  # a document split into pieces: positions_from_doc_ids would restart it
    if not torch.equal(q_pos, positions_from_doc_ids(docs)):
        return _Plan("fallback")
    starts = torch.ones(B, T, dtype=torch.bool, device=docs.device)
    starts[:, 1:] = docs[:, 1:] != docs[:, :-1]
    idx = torch.nonzero(starts.flatten()).flatten()
    cu = torch.cat([idx, idx.new_tensor([B * T])]).to(torch.int32)
    return _Plan("varlen", cu, int((cu[1:] - cu[:-1]).max()))


def _plan(mask: AttentionMask, q_len: int, kv_len: int, device: torch.device) -> _Plan:
    key = (q_len, kv_len, str(device))
    cached = getattr(mask, _CACHE_ATTR, None)
    if cached is not None and cached[0] == key:
        return cached[1]
    plan = _build_plan(mask, q_len, kv_len)
    if not torch.compiler.is_compiling():
        object.__setattr__(mask, _CACHE_ATTR, (key, plan))
    return plan


def _kernel_usable(q: Tensor) -> bool:
    from lightning_llmopt.kernels.flash_attention import resolve_backend

    try:
        return resolve_backend("triton", q.device) == "triton" and q.dtype in (torch.float16, torch.bfloat16,
                                                                               torch.float32)
    except RuntimeError:
        return False


def triton_attention(q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, scale: float) -> Tensor:
    """Flash attention for the model: q ``(B, H, T, D)``, k/v ``(B, H_kv, S, D)`` -> ``(B, H, T, D)``."""
    if not _kernel_usable(q):
        return _sdpa(q, k, v, mask, scale)
    plan = _plan(mask, q.shape[2], k.shape[2], q.device)
    if plan.kind == "fallback":
        return _sdpa(q, k, v, mask, scale)
    from lightning_llmopt.kernels.flash_attention import flash_attention

    if plan.kind == "dense":
        out = flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                              softmax_scale=scale, window=mask.window, backend="triton")  # (B, T, H, D)
        assert isinstance(out, Tensor)
        return out.transpose(1, 2)
    B, H, T, D = q.shape
    packed = [t.transpose(1, 2).reshape(B * T, t.shape[1], D) for t in (q, k, v)]  # (B*T, H, D)
    out = flash_attention(*packed, causal=True, softmax_scale=scale, window=mask.window, cu_seqlens=plan.cu_seqlens,
                          max_seqlen=plan.max_seqlen, backend="triton")
    assert isinstance(out, Tensor)
    return out.view(B, T, H, D).transpose(1, 2)


if "triton" not in registered_backends():
    register_backend("triton", triton_attention)
