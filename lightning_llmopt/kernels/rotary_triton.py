"""Triton rotary-embedding kernel (rotate-half layout) and its launcher, in place or out of place.

One program per (token, block of heads): it loads the token's ``cos``/``sin`` once (from a ``(positions, D/2)``
table through the token's position id, or from per-token ``(B, T, D/2)`` tensors), then rotates every head of the
block: ``(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)`` in fp32, stored in x's dtype. The inverse rotation (the
backward: the rotation is orthogonal, so its gradient is the rotation by the opposite angle) negates ``sin``.
Reads and writes each element of ``x`` once; ``Y`` may be ``X`` (in place).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from lightning_llmopt.kernels.flash_attention_interp import ensure_interpreted_stdlib
from lightning_llmopt.kernels.fused_common import next_pow2, use_interpreter

ensure_interpreted_stdlib()  # before the kernels below are decorated


@triton.jit
def _rotary_kernel(
    X,
    Y,
    COS,
    SIN,
    POS,
    sxb,
    sxt,
    sxh,
    syb,
    syt,
    syh,
    scb,
    sct,
    scd,
    spb,
    spt,
    T,
    H,
    HALF,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HAS_POS: tl.constexpr,
    INVERSE: tl.constexpr,
):
    tok = tl.program_id(0)
    b = (tok // T).to(tl.int64)
    t = (tok % T).to(tl.int64)
    if HAS_POS:
        c_base = tl.load(POS + b * spb + t * spt).to(tl.int64) * sct
    else:
        c_base = b * scb + t * sct
    cols = tl.arange(0, BLOCK_HALF)
    cmask = cols < HALF
    cos = tl.load(COS + c_base + cols * scd, mask=cmask, other=0.0).to(tl.float32)
    sin = tl.load(SIN + c_base + cols * scd, mask=cmask, other=0.0).to(tl.float32)
    if INVERSE:
        sin = -sin
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (heads < H)[:, None] & cmask[None, :]
    heads64 = heads.to(tl.int64)
    x_ptr = X + b * sxb + t * sxt + heads64[:, None] * sxh + cols[None, :]
    x1 = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    y1 = x1 * cos[None, :] - x2 * sin[None, :]
    y2 = x2 * cos[None, :] + x1 * sin[None, :]
    y_ptr = Y + b * syb + t * syt + heads64[:, None] * syh + cols[None, :]
    tl.store(y_ptr, y1.to(Y.dtype.element_ty), mask=mask)
    tl.store(y_ptr + HALF, y2.to(Y.dtype.element_ty), mask=mask)


def rotary_launch(x: Tensor, out: Tensor, cos: Tensor, sin: Tensor, positions: Tensor | None, inverse: bool) -> None:
    """Rotate ``x`` ``(B, T, H, D)`` into ``out`` (same shape; may be ``x``). Last dims contiguous.

    ``positions`` ``(B, T)`` given: ``cos``/``sin`` are ``(P, D/2)`` tables indexed by position; else they are
    ``(B or 1, T, D/2)`` per-token values (a batch dim of 1 broadcasts).
    """
    B, T, H, D = x.shape
    if x.numel() == 0:
        return
    half = D // 2
    if positions is not None:
        scb, sct, scd = 0, cos.stride(0), cos.stride(1)
        spb, spt = positions.stride(0), positions.stride(1)
        pos = positions
    else:
        scb = cos.stride(0) if cos.shape[0] > 1 else 0
        sct, scd = cos.stride(1), cos.stride(2)
        spb = spt = 0
        pos = cos
    block_half = max(16, next_pow2(half))
    if use_interpreter(x):
        block_h, warps = min(16, next_pow2(H)), 1
    else:
        block_h = max(1, min(next_pow2(H), 4096 // block_half))
        warps = 4 if block_h * block_half >= 2048 else 2
    grid = (B * T, triton.cdiv(H, block_h))
    _rotary_kernel[grid](
        x,
        out,
        cos,
        sin,
        pos,
        x.stride(0),
        x.stride(1),
        x.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        scb,
        sct,
        scd,
        spb,
        spt,
        T,
        H,
        half,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        HAS_POS=positions is not None,
        INVERSE=inverse,
        num_warps=warps,
    )


__all__ = ["rotary_launch"]
