"""Triton kernels of the fused linear + cross-entropy: per-row softmax statistics and the in-place logit gradient.

Both work on one chunk of logits ``(C, V_local)`` (the matmul itself is cuBLAS, see
:mod:`~lightning_llmopt.kernels.fused_linear_ce`):

- ``_ce_stats_kernel``: one program per row streams the row in ``BLOCK_V`` pieces with an online max / sum of
  ``exp2((x - max) * log2 e)`` (one exponential per logit), and picks the target logit when the label falls in this
  rank's vocabulary slice; outputs fp32 ``max``, ``sumexp`` and ``target`` per row;
- ``_ce_grad_kernel``: one program per (row, block of ``BLOCK_V`` logits) overwrites the logits with
  ``(softmax - onehot(label)) * scale`` in the logits' dtype (``scale`` is ``1 / n_valid`` for a mean, read from
  device memory so no host sync is needed); rows whose label is ``ignore_index`` get zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_llmopt.kernels.flash_attention_interp import ensure_interpreted_stdlib
from lightning_llmopt.kernels.fused_common import use_interpreter

ensure_interpreted_stdlib()  # before the kernels below are decorated


@triton.jit
def _ce_stats_kernel(
    LOGITS, LABELS, MAX, SUMEXP, TARGET, stride_l, V, vocab_start, ignore_index, BLOCK_V: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride_l
    offs = tl.arange(0, BLOCK_V)
    m = tl.max(tl.full((BLOCK_V,), float("-inf"), tl.float32), axis=0)
    s = tl.sum(tl.zeros((BLOCK_V,), tl.float32), axis=0)
    for v0 in range(0, V, BLOCK_V):
        x = tl.load(base + v0 + offs, mask=v0 + offs < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.math.exp2((m - m_new) * 1.4426950408889634) + tl.sum(
            tl.math.exp2((x - m_new) * 1.4426950408889634), axis=0
        )
        m = m_new
    label = tl.load(LABELS + row).to(tl.int64)
    local = label - vocab_start
    here = (label != ignore_index) & (local >= 0) & (local < V)
    target = tl.load(base + tl.where(here, local, 0), mask=here, other=0.0).to(tl.float32)
    tl.store(MAX + row, m)
    tl.store(SUMEXP + row, s)
    tl.store(TARGET + row, tl.where(here, target, 0.0))


@triton.jit
def _ce_grad_kernel(LOGITS, LABELS, LSE, SCALE, stride_l, V, vocab_start, ignore_index, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < V
    ptr = LOGITS + row * stride_l + cols
    label = tl.load(LABELS + row).to(tl.int64)
    lse = tl.load(LSE + row)
    scale = tl.load(SCALE)
    x = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    p = tl.math.exp2((x - lse) * 1.4426950408889634)
    g = tl.where(cols == label - vocab_start, p - 1.0, p) * scale
    g = tl.where(label == ignore_index, 0.0, g)
    tl.store(ptr, g.to(LOGITS.dtype.element_ty), mask=mask)


def ce_stats_launch(
    logits: Tensor, labels: Tensor, vocab_start: int, ignore_index: int
) -> tuple[Tensor, Tensor, Tensor]:
    """``logits`` ``(C, V)`` (contiguous rows), ``labels`` ``(C,)`` -> fp32 ``(max, sumexp, target)``, each ``(C,)``.

    ``sumexp`` is relative to ``max``: ``lse = max + log(sumexp)``. ``target`` is 0 where the label is ignored or
    outside ``[vocab_start, vocab_start + V)``.
    """
    c, v = logits.shape
    out = torch.empty((3, c), device=logits.device, dtype=torch.float32)
    if c == 0:
        return out[0], out[1], out[2]
    block, warps = (128, 1) if use_interpreter(logits) else (min(4096, triton.next_power_of_2(v)), 8)
    _ce_stats_kernel[(c,)](
        logits,
        labels,
        out[0],
        out[1],
        out[2],
        logits.stride(0),
        v,
        vocab_start,
        ignore_index,
        BLOCK_V=block,
        num_warps=warps,
    )
    return out[0], out[1], out[2]


def ce_grad_launch(
    logits: Tensor, labels: Tensor, lse: Tensor, scale: Tensor, vocab_start: int, ignore_index: int
) -> None:
    """Overwrite ``logits`` ``(C, V)`` with ``(softmax - onehot) * scale`` (0 on ignored rows)."""
    c, v = logits.shape
    if c == 0:
        return
    block, warps = (256, 1) if use_interpreter(logits) else (min(2048, triton.next_power_of_2(v)), 8)
    _ce_grad_kernel[(c, triton.cdiv(v, block))](
        logits, labels, lse, scale, logits.stride(0), v, vocab_start, ignore_index, BLOCK_V=block, num_warps=warps
    )


__all__ = ["ce_grad_launch", "ce_stats_launch"]
