"""Pure-PyTorch reference of :func:`lightning_llmopt.kernels.flash_attention`: the CPU fallback and the test oracle.

Layout (the same as the Triton kernel, and as flash-attn's ``flash_attn_func`` / ``flash_attn_varlen_func``):

- dense: ``q`` ``(B, S_q, H, D)``, ``k``/``v`` ``(B, S_k, H_kv, D)``; output ``(B, S_q, H, D)``, lse ``(B, H, S_q)``;
- packed (``cu_seqlens`` given): ``q`` ``(total, H, D)``, ``k``/``v`` ``(total, H_kv, D)``; document ``i`` holds tokens
  ``cu_seqlens[i]:cu_seqlens[i+1]``; output ``(total, H, D)``, lse ``(H, total)``.

Mask rule for query ``i`` and key ``j`` of one sequence (``off = S_k - S_q``, so that with a longer key sequence the
last query lines up with the last key, flash-attn's bottom-right convention):

    causal:  j <= i + off
    window:  (i + off) - j < window          (``window`` keys, the query's own key included; needs ``causal``)

A query that sees no key returns zeros and ``lse = -inf`` (no NaN, also in the gradients).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["flash_attention_ref", "visible_mask"]


def visible_mask(s_q: int, s_k: int, causal: bool, window: int | None, device: torch.device) -> Tensor:
    """Boolean ``(s_q, s_k)``, True where query ``i`` may see key ``j`` (rule in the module docstring)."""
    q_pos = torch.arange(s_q, device=device)[:, None] + (s_k - s_q)
    k_pos = torch.arange(s_k, device=device)[None, :]
    allowed = torch.ones(s_q, s_k, dtype=torch.bool, device=device)
    if causal:
        allowed &= k_pos <= q_pos
    if window is not None:
        allowed &= (q_pos - k_pos) < window
    return allowed


def _attend(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, window: int | None,
            compute_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """One dense batch: q ``(B, S_q, H, D)``, k/v ``(B, S_k, H_kv, D)`` -> ``(B, S_q, H, D)``, lse ``(B, H, S_q)``."""
    rep = q.shape[2] // k.shape[2]
    qh = q.to(compute_dtype).transpose(1, 2)  # (B, H, S_q, D)
    kh = k.to(compute_dtype).transpose(1, 2).repeat_interleave(rep, dim=1)  # (B, H, S_k, D)
    vh = v.to(compute_dtype).transpose(1, 2).repeat_interleave(rep, dim=1)
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale  # (B, H, S_q, S_k)
    allowed = visible_mask(q.shape[1], k.shape[1], causal, window, q.device)
    scores = scores.masked_fill(~allowed, float("-inf"))
    any_key = allowed.any(dim=-1, keepdim=True)  # (S_q, 1)
    # logsumexp over a row with no visible key is -inf, and exp(s - lse) would be NaN there (in the gradient too):
    # take the lse of a zero row instead and put -inf back afterwards.
    lse = torch.logsumexp(torch.where(any_key, scores, torch.zeros_like(scores)), dim=-1, keepdim=True)
    probs = torch.exp(scores - lse)  # exactly 0 at masked keys, so rows without keys are 0
    out = torch.matmul(probs, vh).transpose(1, 2)  # (B, S_q, H, D)
    lse = torch.where(any_key, lse, torch.full_like(lse, float("-inf"))).squeeze(-1)
    return out.to(q.dtype), lse.to(torch.promote_types(lse.dtype, torch.float32))


def flash_attention_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window: int | None = None,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    return_lse: bool = False,
    upcast: bool = True,
) -> Tensor | tuple[Tensor, Tensor]:
    """Reference attention, differentiable by autograd; arguments and layout as :func:`flash_attention`.

    Arguments:
        upcast: compute in fp32 (or in the input dtype when that is wider, e.g. fp64). ``False`` computes in the
            input dtype: that is "plain PyTorch in the same dtype", whose error the tests use as the tolerance.

    Returns: output in ``q.dtype`` (and the log-sum-exp of the scaled scores, natural log, fp32 or fp64 for fp64
        inputs, if ``return_lse``).
    """
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    compute_dtype = torch.promote_types(q.dtype, torch.float32) if upcast else q.dtype
    if cu_seqlens is None:
        out, lse = _attend(q, k, v, causal, scale, window, compute_dtype)
    else:
        bounds = cu_seqlens.tolist()
        outs, lses = [], []
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            o, lse_doc = _attend(q[None, start:end], k[None, start:end], v[None, start:end], causal, scale, window,
                                 compute_dtype)
            outs.append(o[0])
            lses.append(lse_doc[0])  # (H, len)
        out = torch.cat(outs, dim=0) if outs else q.new_zeros(q.shape)
        lse = torch.cat(lses, dim=1) if lses else q.new_zeros(q.shape[1], 0, dtype=torch.float32)
        if out.shape[0] != q.shape[0]:  # tokens past cu_seqlens[-1] belong to no document
            pad = q.shape[0] - out.shape[0]
            out = torch.cat([out, out.new_zeros(pad, *out.shape[1:])])
            lse = torch.cat([lse, lse.new_full((lse.shape[0], pad), float("-inf"))], dim=1)
    return (out, lse) if return_lse else out
